"""Sample images from any sana2 checkpoint into a PNG grid (a video model's clips into an .mp4 grid).

    python -m sana2.sample CHECKPOINT --prompt "the number 7" [--prompt ...] --out grid.png
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
seed and its place in the grid, not on how many are drawn or on the number of processes. A checkpoint
without a null caption (a diffusers folder from elsewhere) is guided against the empty prompt's
embedding, as diffusers' pipelines do. Without a VAE the latents are the image (the digits run works
in pixels).

A video model draws --num-frames video frames (as diffusers' SanaVideoPipeline counts them: 4k + 1 through
the Wan VAE, which makes k + 1 latent frames) and writes them as one .mp4 grid at --fps (default encoding.fps, 16).

Exit codes: 0 done; 2 a bad argument, checkpoint or config, stated in one line; 1 an internal error.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, PngImagePlugin

from sana2 import staging
from sana2.cli import CONFIG_JSON, CONFIG_TOML, USER_ERROR, dtype_name, torch_dtype
from sana2.components import lora
from sana2.components.initial_load import load_initial_weights
from sana2.components.sampling import make_grid, sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.components.validator import ValidationError, encode_on_rank0, for_display, validation_vae, video_grid
from sana2.config import ConfigError, JobConfig, load_config
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
OUTPUT_KIND = "sana2-sample"  # the PNG's "Software" text chunk: marks a grid this command may replace


DCP_METADATA = ".metadata"  # a DCP folder's index


class SampleError(ValueError):
    """A problem with the arguments, stated in one line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sana2-sample",
        description="Draw images from a sana2 checkpoint (DCP step folder, .pth, safetensors or diffusers folder) "
        "with diffusers' schedulers as SanaPipeline does and classifier-free guidance, into a PNG grid (one row "
        "per prompt).",
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
        "--out", help="the grid to write: a PNG (default samples.png), for a video model an .mp4 (samples.mp4)"
    )
    parser.add_argument("--config", help="the run's TOML config (default: the step folder's config.toml)")
    parser.add_argument("--steps", type=int, help="sampling steps (default: validation.sampling_steps)")
    parser.add_argument("--cfg", type=float, help="guidance scale, 1: none (default: validation.cfg_scale)")
    parser.add_argument("--seed", type=int, help="seeds the noise of every image (default: validation.seed)")
    parser.add_argument("--images-per-prompt", type=int, help="default: validation.images_per_prompt")
    parser.add_argument("--ema", action="store_true", help="the EMA weights of a DCP training checkpoint")
    parser.add_argument("--height", type=int, help="image height in pixels (default: the model's input size)")
    parser.add_argument("--width", type=int, help="image width in pixels (default: the model's input size)")
    parser.add_argument(
        "--num-frames", type=int, help="video models: video frames, 4k + 1 through the Wan VAE (default 1)"
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
        ("--caption-length", "data.caption_length", int),
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
    named = _model_named_by(checkpoint, config.data.caption_length)
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


def latent_shape(model, args, vae_factor: int, temporal_factor: int = 1) -> tuple[int, ...]:
    """[C, (frames,) h, w] of the latents for the requested image size and video frames."""
    video = len(model.patch_size) == 3
    if args.num_frames is not None and not video:
        raise SampleError("--num-frames applies to video models only")
    num_frames = args.num_frames or 1
    if num_frames < 1 or (num_frames - 1) % temporal_factor:
        raise SampleError(f"--num-frames {num_frames}: expected {temporal_factor}k + 1 video frames (the VAE's factor)")
    sizes = []
    for flag, pixels in (("--height", args.height), ("--width", args.width)):
        pixels = model.input_size * vae_factor if pixels is None else pixels
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


def is_own_output(path: Path) -> bool:
    """Whether `path` is a grid (PNG) or clip grid (.mp4) this command wrote."""
    return is_own_clip(path, OUTPUT_KIND) if path.suffix.lower() in VIDEO_EXTENSIONS else is_own_png(path)


def claim_out(args, checkpoint: Path, config: JobConfig) -> Path:
    """--out, checked before any work: a new path or an earlier grid of this command, outside the inputs."""
    vae = validation_vae(config.validation, config.encoding)
    inputs = [checkpoint, *(p for p in (args.config, vae, config.encoding.text_encoder) if p)]
    with torch.device("meta"):  # a video model writes a clip: is it one?
        video = len(build_model(config.model.name, **config.model.overrides).patch_size) == 3
    out = _output_path(args.out, video)
    staging.claim_output(out, OUTPUT_KIND, [p for p in inputs if Path(p).exists()], folder=False, is_own=is_own_output)
    return out


def write_png(images: torch.Tensor, per_row: int, out: Path) -> tuple[int, int]:
    """Grid of images in [-1, 1] as a PNG (published complete or not at all); returns its (width, height)."""
    grid = make_grid(for_display(images), nrow=per_row, padding=2, pad_value=1.0)
    pixels = ((grid.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(np.ascontiguousarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels))
    marker = PngImagePlugin.PngInfo()
    marker.add_text("Software", OUTPUT_KIND)
    with staging.staged(out, replace=True) as temporary:
        image.save(temporary, format="PNG", pnginfo=marker)
    return image.size


def _output_path(out: str | None, video: bool) -> Path:
    if out is None:
        return Path("samples.mp4" if video else "samples.png")
    suffix = Path(out).suffix.lower()
    if video and suffix not in VIDEO_EXTENSIONS:
        raise SampleError(f"--out {out}: a video model writes a clip ({', '.join(VIDEO_EXTENSIONS)})")
    if not video and suffix in VIDEO_EXTENSIONS:
        raise SampleError(f"--out {out}: an image model writes a PNG grid")
    return Path(out)


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
    vae_path = validation_vae(config.validation, config.encoding)
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
        embeds, mask, null_embeds, null_mask = encode_on_rank0(config.encoding, config.data.caption_length, prompts)
    except ValidationError as exc:
        raise config.error(str(exc)) from None
    if tuple(embeds.shape[1:]) != model.caption_shape:
        raise ConfigError(
            f"{config.source}: encoding.text_encoder = {config.encoding.text_encoder!r} with data.caption_length = "
            f"{config.data.caption_length} gives caption embeddings of {tuple(embeds.shape[1:])}; the model takes "
            f"{model.caption_shape} (--text-encoder and --caption-length name others)"
        )
    notes = []
    if NULL_CAPTION_KEY in kept:  # diffusers' convention: guidance against the empty prompt
        model.null_caption().copy_(null_embeds)
        notes.append(f"note: {checkpoint} holds no null caption; guided against the empty prompt's embedding")
    vae_factor = vae.spatial_compression if vae else 1
    shape = latent_shape(model, args, vae_factor, vae.temporal_compression if vae else 1)
    noise = sampling_noise(seed, len(prompts), shape).to(device)
    scheduler = build_scheduler(scheduler_config(settings.scheduler, config.training.flow_shift))
    embeds, mask, null_mask = embeds[:, None].to(device), mask.to(device), null_mask.to(device)
    images = flow_sample(model, noise, embeds, mask, null_mask, steps, cfg, scheduler)
    if rank != 0:
        return None
    if vae is not None:
        images = vae.decode(images)  # rank 0 alone writes the PNG
    staging.claim_output(out, OUTPUT_KIND, folder=False, is_own=is_own_output)  # nothing else took it meanwhile
    try:
        if images.dim() == 5:  # a video model's clips
            fps = args.fps or config.encoding.fps
            grid = video_grid(images, per_prompt)
            write_clip(out, grid, fps, tag=OUTPUT_KIND)
            width, height, kind = grid.shape[-1], grid.shape[-2], f"{grid.shape[1]}-frame clips at {fps:g} fps"
        else:
            (width, height), kind = write_png(images, per_prompt, out), "images"
    except OSError as exc:  # a read-only or full filesystem, a folder without write permission
        raise SampleError(f"cannot write --out {out}: {exc.strerror or exc}") from None
    weights = "EMA" if args.ema else "model"
    notes.append(
        f"wrote {out} ({width}x{height}): {len(args.prompt)} prompt(s) x {per_prompt} {kind} of latents "
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
