"""Precompute training features from a user's images and captions: `python -m sana2.prepare` / `sana2-prepare`.

    sana2-prepare INPUT [INPUT ...] --output DIR --vae VAE_DIR --text-encoder TEXT_ENCODER_DIR \\
        --buckets ASPECT_RATIO_1024 [--shard-text-encoder] ...
    torchrun --nproc_per_node=8 -m sana2.prepare ...      (every rank encodes its share of the shards)

Reads the inputs (sana2/data/sources.py; clips with --num-frames, sana2/data/video_sources.py), gives each image
(or clip) its aspect-ratio bucket, resizes and centre-crops
it to the bucket, encodes it with the VAE and its caption with the text encoder, and writes a version-2
feature dataset (sana2/data/features.py), one bucket per shard. Each shard is written atomically; an
interrupted run started again with the same arguments keeps the shards it finished and encodes the rest.
Unusable inputs are skipped, counted and listed with their reason in `skipped.jsonl`. The summary printed
at the end gives the samples encoded, skipped (by reason) and per bucket.

With --num-frames F (4k + 1) the inputs are clips: each gives F frames at --fps (default 16) through the Wan VAE,
latents [C, (F - 1) / 4 + 1, h, w] (docs/video.md); the frame count and rate are recorded in meta.json.
"""

import argparse
import gc
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from sana2.cli import USER_ERROR, dtype_name, torch_dtype
from sana2.components.text_encoder import TextEncoder, build_text_encoder, resolve_instruction
from sana2.components.vae import Autoencoder, build_autoencoder
from sana2.data.buckets import Bucket, parse_buckets, resample_filter
from sana2.data.plan import make_plan
from sana2.data.prepared_output import Summary, claim_prepared_output, finalize, pending_shards, summarize
from sana2.data.shard_encoding import encode_shards, text_encoder_calls
from sana2.data.sources import list_inputs
from sana2.data.video_decode import START_MODES, FrameWindow
from sana2.data.video_sources import MOTION_SCORE_MODES, list_clips
from sana2.data.writer import write_null_caption
from sana2.distributed.utils import run_on_rank0
from sana2.staging import NoSpaceError


@dataclass
class PrepareOptions:
    inputs: list[str]
    output: str
    buckets: str  # an aspect-ratio table name (ASPECT_RATIO_1024) or one size "HxW"
    vae: str  # a local diffusers autoencoder folder, or "none" (pixels in [-1, 1] are the latents)
    text_encoder: str  # a local Hugging Face model folder, or "tiny-t5"
    max_length: int = 300
    instruction: str = "auto"  # auto: Sana's for a decoder-only encoder, none for T5; "none"; or the text
    caption_proportion: dict[str, float] = field(default_factory=lambda: {"prompt": 1.0})
    caption_suffixes: tuple[str, ...] = ("",)
    min_size: int = 0  # images whose shorter side is smaller are skipped
    seed: int = 0  # caption choice and posterior sampling
    posterior: str = "mode"  # a KL VAE's posterior: its mean ("mode") or a seeded sample ("sample")
    model_dtype: str = "bfloat16"  # the encoders' weights
    feature_dtype: str = "bfloat16"  # the stored latents and caption embeddings
    batch_size: int = 8
    shard_size: int = 256
    workers: int = 4  # image decoding processes per rank
    shard_text_encoder: bool = False  # shard the frozen text encoder over the ranks (1/N of it per rank)
    overwrite: bool = False
    device: str = "auto"
    num_frames: int = 0  # 0: the inputs are images; 4k + 1: clips, this many frames each
    fps: float = 16.0  # clips: the frame rate they are resampled to
    frame_start: str = "first"  # clips: where the frames start ("first", or the middle window: "center")
    motion_score: str = "average"  # Sana zips: how a clip's motion scores make one ("average", "max", "none")
    vae_tiling: bool = False  # the Wan VAE encodes each frame in tiles (less memory, slightly other numbers)

    def window(self) -> FrameWindow | None:
        """The frames each clip gives, or None for images."""
        return FrameWindow(self.num_frames, self.fps, self.frame_start) if self.num_frames else None

    def settings(self) -> dict:
        """What decides the output (not batch size, workers, sharding or device): the plan's fingerprint."""
        keys = ("buckets", "vae", "text_encoder", "max_length", "instruction", "caption_proportion", "caption_suffixes")
        keys += ("min_size", "seed", "posterior", "model_dtype", "feature_dtype", "shard_size")
        settings = {key: getattr(self, key) for key in keys}
        settings["inputs"] = [str(Path(p).resolve()) for p in self.inputs]
        settings["caption_suffixes"] = list(self.caption_suffixes)
        if self.num_frames:  # (absent for images: image datasets prepared before keep their fingerprint)
            settings.update(num_frames=self.num_frames, fps=self.fps, frame_start=self.frame_start)
            settings.update(motion_score=self.motion_score, vae_tiling=self.vae_tiling)
        return settings


# ----------------------------------------------------------------------------------------------
# The run


def prepare(
    options: PrepareOptions,
    vae: Autoencoder | None = None,
    text_encoder: TextEncoder | None = None,
    on_shard_written=None,
) -> Summary:
    """Prepare `options.output`; encoders are built from the options unless given. Every rank calls it.

    `on_shard_written(shard_index)` is called after each shard this rank writes.
    """
    start = time.perf_counter()
    rank, world, device = _process_group(options.device)
    output = Path(options.output)
    buckets = parse_buckets(options.buckets)
    window = options.window()
    if window is None:
        listing = list_inputs(options.inputs, tuple(options.caption_suffixes))
    else:
        listing = list_clips(options.inputs, tuple(options.caption_suffixes), options.motion_score)
    run_on_rank0(lambda: claim_prepared_output(output, options, listing), str, errors=(ValueError,))
    plan = make_plan(
        listing,
        buckets,
        options.caption_proportion,
        options.seed,
        options.min_size,
        options.shard_size,
        options.settings(),
        window,
    )
    if not plan.shards:
        raise ValueError(
            f"no usable samples in {options.inputs}: all {len(plan.skipped)} inputs were skipped, "
            f"e.g. {plan.skipped[:3]}"
        )
    pending = run_on_rank0(lambda: pending_shards(output, plan), str, errors=(ValueError,))
    if pending is not None:
        vae = vae if vae is not None else _build_vae(options, device)
        frames = None if window is None else window.num_frames
        latent_shapes = [_latent_shape(vae, bucket, frames) for bucket in buckets]  # checks the sizes suit the VAE
        text_encoder = text_encoder if text_encoder is not None else _build_text_encoder(options, device, world)
        _encode(options, plan, pending, vae, text_encoder, output, on_shard_written, rank, world)
    _barrier()
    summary = None
    if rank == 0:
        if pending is not None:
            metadata = {
                "producer": "sana2-prepare",
                "options": asdict(options),
                "text_encoder": {"instruction": text_encoder.instruction, "max_length": text_encoder.max_length},
            }
            if window is not None:
                metadata["video"] = {"num_frames": window.num_frames, "fps": window.fps, "start": window.start}
            finalize(output, plan, latent_shapes, metadata)
        written = 0 if pending is None else len(pending)
        summary = summarize(output, written, len(plan.shards) - written, time.perf_counter() - start)
    return run_on_rank0(lambda: summary, str)


def _encode(options, plan, pending, vae, text_encoder, output, on_shard_written, rank, world) -> None:
    """This rank's share of the pending shards (every world-th), and the null caption on rank 0."""
    dtype = torch_dtype(options.feature_dtype)
    null_embeds, null_mask = text_encoder.null_caption()  # on every rank: a collective when sharded
    if rank == 0:
        write_null_caption(output, null_embeds.to(dtype), null_mask)
    encode_shards(
        plan,
        [plan.shards[i] for i in pending[rank::world]],
        vae,
        text_encoder,
        output,
        batch_size=options.batch_size,
        workers=options.workers,
        min_size=options.min_size,
        resample=resample_filter(options.buckets),
        dtype=dtype,
        posterior_seed=options.seed if options.posterior == "sample" else None,
        window=options.window(),
        on_shard_written=on_shard_written,
        show_progress=rank == 0,
    )
    if any(isinstance(p, DTensor) for p in text_encoder.model.parameters()):
        # a sharded encoder's forwards are collectives: match the busiest rank's number of calls
        calls = [text_encoder_calls(plan, pending[r::world], options.batch_size) for r in range(world)]
        for _ in range(max(calls) - calls[rank]):
            text_encoder.encode([""])


# ----------------------------------------------------------------------------------------------
# Set-up


def _latent_shape(vae: Autoencoder | None, bucket: Bucket, frames: int | None = None) -> tuple[int, ...]:
    if vae is None:
        return (3, bucket.height, bucket.width) if frames is None else (3, frames, bucket.height, bucket.width)
    return vae.latent_shape(bucket.height, bucket.width, frames)


def _build_vae(options: PrepareOptions, device) -> Autoencoder | None:
    if options.vae == "none":
        return None
    dtype = torch_dtype(options.model_dtype)
    return build_autoencoder(options.vae, device=device, dtype=dtype, keep_decoder=False, tiling=options.vae_tiling)


def _build_text_encoder(options: PrepareOptions, device, world: int) -> TextEncoder:
    mesh = init_device_mesh(device.type, (world,)) if options.shard_text_encoder and world > 1 else None
    return build_text_encoder(
        options.text_encoder,
        options.max_length,
        device=device,
        dtype=torch_dtype(options.model_dtype),
        instruction=resolve_instruction(options.text_encoder, options.instruction),
        mesh=mesh,
    )


def _process_group(device: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device): the torchrun job's when there is one, else a single process."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from sana2.distributed.utils import init_distributed

        rank, world, _ = init_distributed()
    else:
        rank, world = 0, 1
    if device == "auto":
        local = int(os.environ.get("LOCAL_RANK", 0))
        return rank, world, torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    return rank, world, torch.device(device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> PrepareOptions:
    parser = argparse.ArgumentParser(prog="sana2-prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help="image folders, .jsonl manifests, .tar shards or folders of them")
    parser.add_argument("--output", required=True, help="the dataset folder to write (or to resume)")
    parser.add_argument("--buckets", required=True, help="aspect-ratio table (ASPECT_RATIO_512, _1024, ...) or HxW")
    parser.add_argument("--vae", required=True, help="local diffusers autoencoder folder, or 'none' (pixel space)")
    parser.add_argument("--text-encoder", required=True, help="local Gemma-2 / T5 folder, or 'tiny-t5'")
    parser.add_argument("--max-length", type=int, default=300, help="caption tokens (default 300)")
    parser.add_argument(
        "--instruction",
        default="auto",
        help="caption prefix for a decoder-only encoder: 'auto' (Sana's for Gemma-2, none for T5), 'none', "
        "the text, or @FILE",
    )
    parser.add_argument(
        "--caption-proportion",
        default="prompt=1",
        help="caption types and their weights, e.g. 'prompt=1,InternVL2-26B=2' (default prompt=1)",
    )
    parser.add_argument(
        "--caption-suffixes",
        default="",
        help="comma-separated suffixes of caption side files <stem><suffix>.json (default: only <stem>.json)",
    )
    parser.add_argument("--min-size", type=int, default=0, help="skip images whose shorter side is below this")
    parser.add_argument("--seed", type=int, default=0, help="seed of the caption choice and posterior samples")
    parser.add_argument("--posterior", choices=["mode", "sample"], default="mode", help="a KL VAE's latent")
    dtypes = ("float32", "bfloat16", "float16")
    parser.add_argument("--model-dtype", type=dtype_name, choices=dtypes, default="bfloat16", help="encoder weights")
    parser.add_argument("--feature-dtype", type=dtype_name, choices=dtypes, default="bfloat16", help="stored features")
    parser.add_argument("--batch-size", type=int, default=8, help="images per encoder call")
    parser.add_argument("--shard-size", type=int, default=256, help="samples per shard")
    parser.add_argument("--workers", type=int, default=4, help="image decoding processes per rank")
    parser.add_argument("--shard-text-encoder", action="store_true", help="shard the text encoder over the ranks")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--device", default="auto", help="'auto' (this rank's GPU, else CPU), 'cpu', 'cuda:0', ...")
    video = parser.add_argument_group("clips (docs/video.md)")
    video.add_argument("--num-frames", type=int, default=0, help="the inputs are clips: frames per clip, 4k+1 (81)")
    video.add_argument("--fps", type=float, default=16.0, help="the frame rate clips are resampled to (default 16)")
    video.add_argument("--frame-start", choices=START_MODES, default="first", help="where a clip's frames start")
    video.add_argument("--motion-score", choices=MOTION_SCORE_MODES, default="average", help="Sana zips' scores")
    video.add_argument("--vae-tiling", action="store_true", help="the Wan VAE encodes frames in tiles")
    values = vars(parser.parse_args(argv))
    if values["instruction"].startswith("@"):
        values["instruction"] = Path(values["instruction"][1:]).read_text()
    values["caption_proportion"] = _proportion(parser, values["caption_proportion"])
    values["caption_suffixes"] = tuple(values["caption_suffixes"].split(","))
    try:
        options = PrepareOptions(**values)
        options.window()
    except ValueError as exc:
        parser.error(f"--num-frames / --fps: {exc}")
    return options


def _proportion(parser, text: str) -> dict[str, float]:
    proportion = {}
    for item in text.split(","):
        kind, _, weight = item.partition("=")
        try:
            proportion[kind.strip()] = float(weight)
        except ValueError:
            parser.error(f"--caption-proportion: expected TYPE=WEIGHT items, got {item!r}")
    if not proportion or min(proportion.values()) < 0 or sum(proportion.values()) <= 0:
        parser.error("--caption-proportion: weights must be non-negative and not all zero")
    return proportion


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        summary = prepare(options)
    except (ValueError, FileNotFoundError, NoSpaceError) as exc:
        print(f"sana2-prepare: error: {exc}", file=sys.stderr)
        return USER_ERROR
    finally:
        # free the sharded encoder (its FSDP state holds the process group) while Python is fully alive:
        # left to interpreter exit, tearing down gloo's threads can abort the process
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(summary.lines(Path(options.output))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
