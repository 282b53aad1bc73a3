"""Sample images from any sana2 checkpoint into one PNG per image (a video model's clips: one .mp4 each).

    python -m sana2.sample CHECKPOINT --prompt "the number 7" [--prompt ...] [--out FOLDER | --grid --out grid.png]
        [--config run.toml] [--steps N] [--cfg S] [--seed N] [--images-per-prompt N] [--ema]
        [--height H --width W] [--num-frames F] [--fps R] [--dtype float32|bfloat16]
        [--model NAME] [--text-encoder NAME] [--caption-length L] [--vae PATH] [--flow-shift S]
        [--scheduler dpm-solver|euler]
    torchrun --nproc_per_node N -m sana2.sample ...      (the model stays sharded over the processes)
    (also installed as `sana2-sample`)

CHECKPOINT is a DCP step folder (saved at any world size), a `.pth` or Accelerate `.bin`, a
safetensors file or folder, or a diffusers transformer folder: whatever
`checkpoint.initial_load_path` takes, read by the same loader. The run's config supplies the model,
the text encoder and caption length, the VAE and the flow shift: a step folder's own
`config.toml`, else `--config`, else the defaults (the digits run); a diffusers folder describes its
model itself. The flags override single settings; --steps, --cfg, --seed and --images-per-prompt
default to the config's [validation] values.

Sampling is the validator's and diffusers' SanaPipeline's (sana2/components/schedulers.py): diffusers'
DPM-Solver multistep on flow sigmas (`--scheduler dpm-solver`, the default) or flow-matching Euler
(`--scheduler euler`), classifier-free guidance against the model's null caption with the empty
prompt's mask, and each image's noise drawn from its own seeded generator, so an image depends on the
seed, its prompt's place and its number, not on how many are drawn or on the number of processes. A checkpoint
without a null caption (a diffusers folder from elsewhere) is guided against the empty prompt's
embedding, as diffusers' pipelines do. Without a VAE the latents are the image (the digits run works
in pixels).

The default size is the one the run trained at most (the most common bucket of its data.path, as its
validation samples), else the model's input size (a diffusers folder's sample_size, as SanaPipeline's
default). A video model draws --num-frames video frames (as diffusers' SanaVideoPipeline counts them: 4k + 1
through the Wan VAE, which makes k + 1 latent frames) at --fps (default encoding.fps, 16).

Output: --out (default samples/) is a folder of one file per sample, named after its prompt
(`0-the_number_7.png`, `0-the_number_7-1.png` with several per prompt; sana2/components/sample_files.py),
exactly the image, without a frame. --grid writes one grid file instead (--out, default samples.png or
samples.mp4), a row per prompt. Nothing but this command's own earlier output is replaced: a folder it
marked (sana2_output.json, listing the files it wrote) holding nothing else, or a grid file carrying its
mark; never a path that is, holds or lies inside an input, the working directory or a training run's
folder (validation writes a run's samples to <dump_folder>/samples/step-<N>/).

Exit codes: 0 done; 2 a bad argument, checkpoint or config, stated in one line; 1 an internal error.
"""

import argparse
import json
import math
import os
import sys
import tomllib
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image

from sana2 import staging
from sana2.cli import CONFIG_JSON, CONFIG_TOML, USER_ERROR, dtype_name, torch_dtype
from sana2.components import lora
from sana2.components.initial_load import load_initial_weights
from sana2.components.ownership import OWNER_FILE
from sana2.components.sample_files import for_display, image_grid, video_grid, write_png, write_samples
from sana2.components.sampling import sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.components.validator import ValidationError, encode_on_rank0
from sana2.config import ConfigError, JobConfig, load_config
from sana2.data.features import most_common_latent_shape, read_buckets
from sana2.data.video_decode import VIDEO_EXTENSIONS, is_own_clip, write_clip
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.parallelize import apply_fsdp, materialize
from sana2.distributed.utils import init_distributed
from sana2.encoders.autoencoder import build_autoencoder
from sana2.formats.diffusers import DiffusersFormatError, sana2_model
from sana2.formats.diffusers_folder import NULL_CAPTION_KEY
from sana2.formats.diffusers_folder import read_config as read_diffusers_config
from sana2.formats.pipeline import pipeline_defaults, pipeline_root, resolve_pipeline
from sana2.formats.tensors import CheckpointError
from sana2.models import ModelConfigError, build_model

# the step folder's config.toml is the trainer's; `sana2-convert --to-dcp` of a diffusers folder names the
# model in its config.json
# the marker of this command's output: in its folder's sana2_output.json (with the files it wrote), and in each
# PNG's "Software" text chunk and .mp4's comment (a --grid file this command may replace)
OUTPUT_KIND = "sana2-sample"


DCP_METADATA = ".metadata"  # a DCP folder's index


class SampleError(ValueError):
    """A problem with the arguments, stated in one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sana2-sample",
        description="Draw images from a sana2 checkpoint (DCP step folder, .pth, safetensors or diffusers folder) "
        "with diffusers' schedulers as SanaPipeline does and classifier-free guidance, into one PNG per image "
        "(a video model: one .mp4 per clip), or a grid with --grid.",
        epilog="exit codes: 0 done; 2 a bad argument, checkpoint or config, stated in one line; 1 internal error",
    )
    parser.add_argument(
        "checkpoint",
        nargs="?",
        help="DCP step folder, .pth/.bin, .safetensors file or folder, diffusers transformer or pipeline folder "
        "(default: --pretrained's transformer)",
    )
    parser.add_argument("--prompt", action="append", required=True, help="a caption; repeat for more rows")
    parser.add_argument(
        "--out",
        help="the folder to write, one PNG per image (a video model: one .mp4 per clip) named after its prompt "
        "(default samples/); with --grid the grid file (default samples.png, a video model's samples.mp4)",
    )
    parser.add_argument(
        "--grid", action="store_true", help="one grid image (or .mp4) instead, a row per prompt, --out its file"
    )
    parser.add_argument("--config", help="the run's TOML config (default: the step folder's config.toml)")
    parser.add_argument("--steps", type=int, help="sampling steps (default: validation.sampling_steps)")
    parser.add_argument("--cfg", type=float, help="guidance scale, 1: none (default: validation.cfg_scale)")
    parser.add_argument("--seed", type=int, help="seeds the noise of every image (default: validation.seed)")
    parser.add_argument("--images-per-prompt", type=int, help="default: validation.images_per_prompt")
    parser.add_argument("--ema", action="store_true", help="the EMA weights of a DCP training checkpoint")
    trained = "the size the run trained at most (its data.path's largest bucket), else the model's input size"
    parser.add_argument("--height", type=int, help=f"image height in pixels (default: {trained})")
    parser.add_argument("--width", type=int, help=f"image width in pixels (default: {trained})")
    parser.add_argument(
        "--num-frames",
        type=int,
        help="video models: video frames, 4k + 1 through the Wan VAE (default: the run's data.path's, else 1)",
    )
    parser.add_argument("--fps", type=float, help="video models: the clip's frame rate (default encoding.fps)")
    parser.add_argument(
        "--dtype", type=dtype_name, choices=("float32", "bfloat16"), default="float32", help="the model's compute dtype"
    )
    parser.add_argument("--device", help="default: cuda if available, else cpu (under torchrun: each rank's)")
    for flag, key, kind in (
        ("--model", "model.name", str),
        ("--pretrained", "model.pretrained", str),
        ("--text-encoder", "encoding.text_encoder", str),
        ("--caption-length", "model.model_max_length", int),
        ("--vae", "validation.vae", str),
        ("--flow-shift", "training.flow_shift", float),
        ("--scheduler", "validation.scheduler", str),
    ):
        parser.add_argument(flag, type=kind, dest=key.replace(".", "__"), help=f"overrides the config's {key}")
    return parser


# -- what to build --------------------------------------------------------------------------------


def run_config(args, checkpoint: Path) -> JobConfig:
    """The run's config with the flags' overrides; the model replaced by a diffusers folder's own."""
    path = args.config
    if path is None and checkpoint.is_dir() and (checkpoint / CONFIG_TOML).is_file():
        path = checkpoint / CONFIG_TOML
    overrides = [
        f"--{key.replace('__', '.')}={json.dumps(value)}"
        for key, value in vars(args).items()
        if "__" in key and value is not None
    ]
    config = load_config(path, overrides, pipeline_defaults)
    named = _model_named_by(checkpoint, config.caption_length)
    if named is not None and args.model__name is None:
        config.model.name, config.model.overrides = named
    return config


def _model_named_by(checkpoint: Path, caption_length: int) -> tuple[str, dict] | None:
    """The model a diffusers folder (or a --to-dcp folder made from one) describes, if it is one."""
    if not checkpoint.is_dir():
        return None
    diffusers = read_diffusers_config(checkpoint)
    if diffusers is not None:
        name, kwargs = sana2_model(diffusers)
        return name, {**kwargs, "model_max_length": caption_length}
    if (checkpoint / CONFIG_TOML).is_file():
        return None
    try:
        model = dict(json.loads((checkpoint / CONFIG_JSON).read_text()).get("model") or {})
    except (OSError, ValueError, AttributeError):
        return None
    name = model.pop("name", None)
    model.pop("pretrained", None)  # where the run started from, not a model keyword
    return (name, {"model_max_length": caption_length, **model}) if name else None


def trained_latent_shape(config: JobConfig, model) -> tuple[int, ...] | None:
    """The latent shape the run trained at most (its precomputed data's most common bucket, as its validation
    samples), when its data.path is here and fits the model; None otherwise (a diffusers folder's default
    config, online data, the embedded digits: the model's input size is the default then)."""
    if config.data.mode != "precomputed" or config.data.path == "digits":
        return None
    try:
        shape = most_common_latent_shape(read_buckets(config.data.path))
    except (OSError, ValueError, KeyError, TypeError):  # not here, or not a dataset: no default from it
        return None
    if len(shape) != len(model.patch_size) + 1 or shape[0] != model.in_channels:
        return None
    return shape


def latent_shape(model, args, vae_factor: int, temporal_factor: int = 1, trained=None) -> tuple[int, ...]:
    """[C, (frames,) h, w] of the latents for the requested image size and video frames; what the flags leave
    out is the `trained` latent shape's (else one frame at the model's input size)."""
    video = len(model.patch_size) == 3
    if args.num_frames is not None and not video:
        raise SampleError("--num-frames applies to video models only")
    num_frames = args.num_frames or ((trained[1] - 1) * temporal_factor + 1 if video and trained else 1)
    if num_frames < 1 or (num_frames - 1) % temporal_factor:
        raise SampleError(f"--num-frames {num_frames}: expected {temporal_factor}k + 1 video frames (the VAE's factor)")
    sizes = []
    for flag, pixels, side in (("--height", args.height, -2), ("--width", args.width, -1)):
        if pixels is None:
            pixels = (trained[side] if trained else model.input_size) * vae_factor
        step = vae_factor * model.patch_size[-1]
        if pixels <= 0 or pixels % step:
            raise SampleError(f"{flag} {pixels}: expected a positive multiple of {step} pixels (VAE factor x patch)")
        sizes.append(pixels // vae_factor)
    frames = [(num_frames - 1) // temporal_factor + 1] if video else []
    return (model.in_channels, *frames, *sizes)


# -- sampling ----------------------------------------------------------------------------------------


def load_model(config: JobConfig, checkpoint: Path, ema: bool, dtype: torch.dtype, device, mesh):
    """The config's model with the checkpoint's weights (sharded over `mesh` if given); returns it and
    the keys the checkpoint did not hold."""
    # a LoRA run's step folder holds its adapters; its base is the run's initial load
    adapters = lora.enabled(config) and (checkpoint / DCP_METADATA).is_file()
    with torch.device("meta"):
        model = build_model(config.model.name, **config.model.overrides)
        if adapters:
            model = lora.add_adapters(model, config)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32)
        materialize(model, device)
    else:
        model.to_empty(device=device)
    init_weights(model, seed=0)  # for what the checkpoint need not hold: pos_embed, a missing null caption
    if adapters:
        if not config.checkpoint.initial_load_path:
            raise SampleError(f"{checkpoint}: LoRA adapters whose run names no base (checkpoint.initial_load_path)")
        load_initial_weights(model, config.checkpoint.initial_load_path)
        kept = lora.load_adapters(model, checkpoint, ema)
    else:
        kept = load_initial_weights(model, checkpoint, ema=ema)
    if mesh is None:
        model.to(dtype)
    return model.eval(), kept


def is_own_png(path: Path) -> bool:
    """Whether `path` is a grid this command wrote (so a new one may replace it)."""
    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == OUTPUT_KIND
    except (OSError, ValueError):
        return False


def is_own_grid(path: Path) -> bool:
    """Whether `path` is a grid (PNG) or clip grid (.mp4) this command wrote."""
    return is_own_clip(path, OUTPUT_KIND) if path.suffix.lower() in VIDEO_EXTENSIONS else is_own_png(path)


def run_folder_holding(path: Path) -> Path | None:
    """The training run's folder (a dump folder or a step folder: it holds the trainer's config.toml or
    owner.json) that `path` is or lies inside, if any."""
    for folder in (Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents):
        if (folder / OWNER_FILE).is_file():
            return folder
        try:
            if "job" in tomllib.loads((folder / CONFIG_TOML).read_text()):
                return folder
        except (OSError, ValueError):  # none, or another program's config.toml
            continue
    return None


def claim_out(args, checkpoint: Path, config: JobConfig) -> Path:
    """--out, checked before any work: a new path or an earlier output of this command (a grid file, or a
    folder it marked and holding only what it wrote), outside the inputs, the working directory and any
    training run's folder."""
    vae, _ = config.validation.vae_setting(config.encoding)
    inputs = [checkpoint, *(p for p in (args.config, vae, config.encoding.text_encoder) if p)]
    with torch.device("meta"):  # a video model writes clips: is it one?
        video = len(build_model(config.model.name, **config.model.overrides).patch_size) == 3
    out = _output_path(args.out, video, args.grid)
    if staging.overlap(Path.cwd(), out) in ("is", "lies inside"):
        raise staging.OutputRefused(f"refusing to write {out}: it is the working directory or holds it")
    run_folder = run_folder_holding(out)
    if run_folder is not None:
        raise staging.OutputRefused(
            f"refusing to write {out}: it is or lies inside the training run's folder {run_folder}; choose an "
            "output outside it (validation writes its samples to <dump_folder>/samples/)"
        )
    existing = [p for p in inputs if Path(p).exists()]
    staging.claim_output(out, OUTPUT_KIND, existing, folder=not args.grid, is_own=is_own_grid if args.grid else None)
    return out


def _output_path(out: str | None, video: bool, grid: bool) -> Path:
    if not grid:
        path = Path("samples" if out is None else out)
        if path.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", *VIDEO_EXTENSIONS):
            raise SampleError(
                f"--out {out}: names a file; sana2-sample writes a folder of one file per sample "
                "(pass --grid for one grid file)"
            )
        return path
    if out is None:
        return Path("samples.mp4" if video else "samples.png")
    suffix = Path(out).suffix.lower()
    if video and suffix not in VIDEO_EXTENSIONS:
        raise SampleError(f"--out {out}: a video model's --grid is a clip ({', '.join(VIDEO_EXTENSIONS)})")
    if not video and suffix != ".png":
        raise SampleError(f"--out {out}: an image model's --grid is a PNG")
    return Path(out)


def write_output(images: torch.Tensor, args, per_prompt: int, out: Path, fps: float) -> tuple[int, int]:
    """Rank 0's images (or decoded clips) at `out`: a folder of one file per sample, marked with what it
    holds, or one grid (--grid); either published whole. Returns one sample's (or the grid's) width, height."""
    if not args.grid:
        with staging.staged(out, replace=True) as temporary:
            files = write_samples(images, args.prompt, per_prompt, temporary, fps, tag=OUTPUT_KIND)
            staging.mark_output(temporary, OUTPUT_KIND, files=[file.name for file in files])
        shown = for_display(images[:1, :, 0] if images.dim() == 5 else images[:1])
        return shown.shape[-1], shown.shape[-2]
    if images.dim() == 5:
        grid = video_grid(images, per_prompt)
        write_clip(out, grid, fps, tag=OUTPUT_KIND)
        return grid.shape[-1], grid.shape[-2]
    return write_png(image_grid(for_display(images), per_prompt), out, tag=OUTPUT_KIND)


def checkpoint_to_sample(args) -> Path:
    """The checkpoint the arguments name; a pipeline folder (or its transformer/) becomes --pretrained, so
    that its VAE, text encoder, flow shift and guidance are the defaults, and its transformer the weights."""
    if args.checkpoint is None:
        if args.model__pretrained is None:
            raise SampleError("expected a checkpoint, or --pretrained PIPELINE to sample its transformer")
        return Path(resolve_pipeline(args.model__pretrained)) / "transformer"
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise SampleError(f"checkpoint {checkpoint} does not exist")
    root = pipeline_root(checkpoint)
    if root is None:
        return checkpoint
    if args.model__pretrained is None:
        args.model__pretrained = str(root)
    return root / "transformer"


def sample(args) -> str | None:
    try:
        checkpoint = checkpoint_to_sample(args)
    except ValueError as exc:  # a pretrained pipeline that cannot be found
        raise SampleError(f"--pretrained {args.model__pretrained}: {exc}") from None
    for flag, value in (("--steps", args.steps), ("--images-per-prompt", args.images_per_prompt)):
        if value is not None and value < 1:
            raise SampleError(f"{flag} {value}: expected 1 or more")
    for flag, value in (("--cfg", args.cfg), ("--flow-shift", args.training__flow_shift)):
        if value is not None and not math.isfinite(value):  # nan guides every pixel to nan: a blank image
            raise SampleError(f"{flag} {value}: expected a finite number")
    config = run_config(args, checkpoint)
    out = claim_out(args, checkpoint, config)
    settings = config.validation
    if args.fps is not None and not args.fps > 0:
        raise SampleError(f"--fps {args.fps}: expected a positive frame rate")
    steps, cfg = args.steps or settings.sampling_steps, settings.cfg_scale if args.cfg is None else args.cfg
    seed = settings.seed if args.seed is None else args.seed
    per_prompt = args.images_per_prompt or settings.images_per_prompt
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        rank, world_size, device = init_distributed()
        mesh = ParallelDims(1, world_size, device_type=device.type).fsdp_mesh
    else:
        rank, device, mesh = 0, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")), None
    vae_path, _ = config.validation.vae_setting(config.encoding)
    try:  # before the model: a wrong VAE path fails in seconds
        vae = build_autoencoder(vae_path, device=device) if vae_path else None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config.source}: the VAE {vae_path!r} cannot be loaded: {exc}") from None
    model, kept = load_model(config, checkpoint, args.ema, torch_dtype(args.dtype), device, mesh)
    if vae is not None and vae.latent_channels != model.in_channels:  # before sampling, not after every step
        raise ConfigError(
            f"{config.source}: the VAE {vae_path!r} has {vae.latent_channels} latent channels; the model "
            f"{config.model.name} takes {model.in_channels} (--vae names another)"
        )

    prompts = [prompt for prompt in args.prompt for _ in range(per_prompt)]
    try:
        embeds, mask, null_embeds, null_mask = encode_on_rank0(config.encoding, model.caption_shape[0], prompts)
    except ValidationError as exc:
        raise config.error(str(exc)) from None
    if tuple(embeds.shape[1:]) != model.caption_shape:
        raise ConfigError(
            f"{config.source}: encoding.text_encoder = {config.encoding.text_encoder!r} gives caption embeddings of "
            f"{tuple(embeds.shape[1:])}; the model takes {model.caption_shape} (--text-encoder names another)"
        )
    notes = []
    if NULL_CAPTION_KEY in kept:  # diffusers' convention: guidance against the empty prompt
        model.null_caption().copy_(null_embeds)
        notes.append(f"note: {checkpoint} holds no null caption; guided against the empty prompt's embedding")
    vae_factor = vae.spatial_compression if vae else 1
    trained = trained_latent_shape(config, model)
    shape = latent_shape(model, args, vae_factor, vae.temporal_compression if vae else 1, trained)
    noise = sampling_noise(seed, len(prompts), shape).to(device)
    scheduler = build_scheduler(scheduler_config(settings.scheduler, config.training.flow_shift))
    embeds, mask, null_mask = embeds[:, None].to(device), mask.to(device), null_mask.to(device)
    images = flow_sample(model, noise, embeds, mask, null_mask, steps, cfg, scheduler)
    if rank != 0:
        return None
    if vae is not None:
        images = vae.decode(images)  # rank 0 alone writes the PNG
    # nothing else took it meanwhile
    staging.claim_output(out, OUTPUT_KIND, folder=not args.grid, is_own=is_own_grid if args.grid else None)
    fps = args.fps or config.encoding.fps
    try:
        width, height = write_output(images, args, per_prompt, out, fps)
    except OSError as exc:  # a read-only or full filesystem, a folder without write permission
        raise SampleError(f"cannot write --out {out}: {exc.strerror or exc}") from None
    kind = f"{images.shape[2]}-frame clips at {fps:g} fps" if images.dim() == 5 else "images"
    what = f"a grid of {width}x{height}" if args.grid else f"{len(prompts)} files of {width}x{height}"
    weights = "EMA" if args.ema else "model"
    notes.append(
        f"wrote {out} ({what}): {len(args.prompt)} prompt(s) x {per_prompt} {kind} of latents "
        f"{tuple(shape)}, {steps} {settings.scheduler} steps, cfg {cfg}, flow shift {config.training.flow_shift}, "
        f"seed {seed}, "
        f"{weights} weights of {config.model.name} from {checkpoint}"
    )
    return "\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        message = sample(args)
    except (
        SampleError,
        ConfigError,
        CheckpointError,
        DiffusersFormatError,
        ModelConfigError,
        staging.OutputRefused,
    ) as exc:
        print(f"sana2-sample: error: {exc}", file=sys.stderr)
        return USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if message:
        print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
