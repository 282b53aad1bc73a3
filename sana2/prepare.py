"""Precompute training features from a user's images and captions: `python -m sana2.prepare` / `sana2-prepare`.

    sana2-prepare INPUT [INPUT ...] --output DIR --vae VAE_DIR --text-encoder TEXT_ENCODER_DIR \\
        --buckets ASPECT_RATIO_1024 [--shard-text-encoder] ...
    python -m sana2.launch --nproc_per_node=8 -m sana2.prepare ...   (every rank encodes its share of the shards;
                                                                      torchrun's agent, exit 0 on SIGTERM)

Reads the inputs (sana2/data/sources.py; clips with --num-frames, sana2/data/video_sources.py), gives each image
(or clip) its aspect-ratio bucket, resizes and centre-crops
it to the bucket, encodes it with the VAE and its caption with the text encoder, and writes a version-2
feature dataset (sana2/data/features.py), one bucket per shard. Each shard is written atomically; an
interrupted run started again with the same arguments keeps the shards it finished and encodes the rest.
Unusable inputs are skipped, counted and listed with their reason in `skipped.jsonl`. The summary printed
at the end gives the samples encoded, skipped (by reason) and per bucket. SIGTERM or SIGINT (a scheduler's
preemption, Ctrl-C; the sana2 launcher forwards them to every rank) stops the run before the next batch, keeping
the finished shards: it exits 0 with "stopped; rerun to resume", and the rerun ends with the same dataset. The
signal handler only notes the signal; the ranks agree on the stop before each batch (`ShardStops`), so no write
or collective is ever cut short.

With --num-frames F (4k + 1) the inputs are clips: each gives F frames at --fps (default 16) through the Wan VAE,
latents [C, (F - 1) / 4 + 1, h, w] (docs/video.md); the frame count and rate are recorded in meta.json.
"""

import argparse
import dataclasses
import gc
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sana2.cli import DTYPE_HELP, USER_ERROR, dtype_name, torch_dtype
from sana2.components.preemption import StopSignal, agreed_max
from sana2.config import ConfigError, Encoding, load_config
from sana2.data.buckets import parse_buckets, resample_filter
from sana2.data.dataset_plan import plan_dataset
from sana2.data.frame_window import START_MODES, FrameWindow
from sana2.data.prepared_output import Summary, claim_prepared_output, finalize, pending_shards, summarize
from sana2.data.shard_encoding import (
    build_encoding_text_encoder,
    build_encoding_vae,
    encode_shards,
    latent_shape,
)
from sana2.data.video_sources import MOTION_SCORE_MODES, list_encoding_inputs
from sana2.data.writer import write_null_caption
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.utils import run_on_rank0
from sana2.encoders.autoencoder import Autoencoder, autoencoder_class
from sana2.encoders.text_encoder import TextEncoder, check_text_encoder_name
from sana2.formats.pipeline import pipeline_defaults
from sana2.staging import NoSpaceError


@dataclass
class PrepareOptions:
    """What to encode, how (`encoding`: the [encoding] section training's online mode reads too) and what
    is prepare's own: the caption length it writes, the stored dtype, the shard layout, where it runs."""

    inputs: list[str]
    output: str
    encoding: Encoding = field(default_factory=Encoding)
    max_length: int = 300  # caption tokens (the model's model_max_length; Sana: 300)
    feature_dtype: str = "bfloat16"  # the stored latents and caption embeddings
    batch_size: int = 8
    shard_size: int = 256
    overwrite: bool = False
    device: str = "auto"

    def window(self) -> FrameWindow | None:
        """The frames each clip gives, or None for images."""
        return self.encoding.window()

    def settings(self) -> dict:
        """What decides the output (not batch size, workers, sharding or device): the plan's fingerprint."""
        settings = {**self.encoding.settings(), "max_length": self.max_length}
        settings |= {"feature_dtype": self.feature_dtype, "shard_size": self.shard_size}
        settings["inputs"] = [str(Path(p).resolve()) for p in self.inputs]
        return settings


# ----------------------------------------------------------------------------------------------
# The run


def prepare(
    options: PrepareOptions,
    vae: Autoencoder | None = None,
    text_encoder: TextEncoder | None = None,
    on_shard_written=None,
    stop_signal: StopSignal | None = None,
) -> Summary:
    """Prepare `options.output`; encoders are built from the options unless given. Every rank calls it.

    `on_shard_written(shard_index)` is called after each shard this rank writes. Once `stop_signal` (installed by
    the caller) has noted a signal on any rank, every rank raises Stopped before its next batch.
    """
    start = time.perf_counter()
    rank, world, device = _process_group(options.device)
    output = Path(options.output)
    encoding = options.encoding
    buckets = parse_buckets(encoding.buckets)
    window = options.window()
    listing = list_encoding_inputs(options.inputs, encoding)
    run_on_rank0(lambda: claim_prepared_output(output, options, listing), str, errors=(ValueError,))
    plan = plan_dataset(
        listing,
        buckets,
        encoding.caption_proportion,
        encoding.seed,
        encoding.min_size,
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
        vae = vae if vae is not None else build_encoding_vae(encoding, device)
        frames = None if window is None else window.num_frames
        latent_shapes = [latent_shape(vae, bucket, frames) for bucket in buckets]  # checks the sizes suit the VAE
        if text_encoder is None:
            # prepare is data-parallel over every rank
            dims = ParallelDims(1, world, device_type=device.type)
            text_encoder = build_encoding_text_encoder(encoding, options.max_length, device, dims)
        stops = ShardStops(stop_signal or StopSignal())
        _encode(options, plan, pending, vae, text_encoder, output, on_shard_written, stops, rank, world)
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
        summary = summarize(output, pending or [], time.perf_counter() - start)
    return run_on_rank0(lambda: summary, str)


def _encode(options, plan, pending, vae, text_encoder, output, on_shard_written, stops, rank, world) -> None:
    """This rank's share of the pending shards (every world-th), and the null caption on rank 0; Stopped on
    every rank at the same batch when the ranks agree to stop."""
    dtype = torch_dtype(options.feature_dtype)
    null_embeds, null_mask = text_encoder.null_caption()  # on every rank: a collective when sharded
    if rank == 0:
        write_null_caption(output, null_embeds.to(dtype), null_mask)
    finished = encode_shards(
        plan,
        [plan.shards[i] for i in pending[rank::world]],
        vae,
        text_encoder,
        output,
        batch_size=options.batch_size,
        workers=options.encoding.workers,
        min_size=options.encoding.min_size,
        resample=resample_filter(options.encoding.buckets),
        dtype=dtype,
        posterior_seed=options.encoding.seed if options.encoding.posterior == "sample" else None,
        window=options.window(),
        on_shard_written=on_shard_written,
        show_progress=rank == 0,
        stop_here=stops.stop_here,
    )
    sharded = any(isinstance(p, DTensor) for p in text_encoder.model.parameters())
    while finished and stops.others_working():
        if sharded:  # its forwards are collectives: one call for each batch the busy ranks make
            text_encoder.encode([""])
    if stops.signum:
        raise Stopped(signal.Signals(stops.signum).name)


class ShardStops:
    """The stop every rank takes alike: the signal handler (StopSignal) only notes the signal on the rank that got
    it; before each batch every rank says whether it got one and whether it still has batches to do, in one
    all-reduce (`agreed_max`, as training's StopAgreement). A stop ends every rank there, each keeping the shards it
    finished and leaving its shard in progress to the rerun. A rank whose share is done keeps answering until
    every rank's is (each answer then matched by a padding call of a sharded text encoder)."""

    def __init__(self, stop_signal: StopSignal):
        self.signal = stop_signal
        self.signum = 0  # the agreed signal (the largest number any rank got), 0 while none

    def stop_here(self) -> bool:
        """Before each of this rank's batches: True if the ranks stop now."""
        return self._agree(working=True)[0]

    def others_working(self) -> bool:
        """Once this rank's batches are done: True while another rank still encodes and no stop was agreed."""
        stop, working = self._agree(working=False)
        return working and not stop

    def _agree(self, working: bool) -> tuple[bool, bool]:
        signum, working = agreed_max([float(self.signal.signum), float(working)])
        self.signum = int(signum)
        return bool(signum), bool(working)


# ----------------------------------------------------------------------------------------------
# Set-up


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


# flag -> Encoding field; a flag left out takes the field's value from --config's [encoding], else its default
ENCODING_FLAGS = {
    "text_encoder": "text_encoder",
    "instruction": "instruction",
    "model_dtype": "dtype",
    "vae": "vae",
    "posterior": "posterior",
    "buckets": "buckets",
    "caption_proportion": "caption_proportion",
    "caption_suffixes": "caption_suffixes",
    "seed": "seed",
    "min_size": "min_size",
    "shard_text_encoder": "shard_text_encoder",
    "workers": "workers",
    "num_frames": "num_frames",
    "fps": "fps",
    "frame_start": "frame_start",
    "motion_score": "motion_score",
    "vae_tiling": "vae_tiling",
}


def parse_args(argv: list[str] | None = None) -> PrepareOptions:
    defaults = Encoding()
    parser = argparse.ArgumentParser(
        prog="sana2-prepare",
        description=__doc__.split("\n\n")[0],
        epilog="The encoding flags are the [encoding] section of a training config (sana2/config.py's Encoding, "
        "which online mode reads too), with its defaults; --config takes them from a config. Exit codes: 0 done; "
        f"{USER_ERROR} a bad argument or input, stated in one line; 1 internal error.",
    )
    parser.add_argument("inputs", nargs="+", help="image folders, .jsonl manifests, .tar shards or folders of them")
    parser.add_argument("--output", required=True, help="the dataset folder to write (or to resume)")
    parser.add_argument(
        "--config",
        help="a training config: its [encoding] section and model.model_max_length set what the flags do not",
    )
    parser.add_argument(
        "--buckets", help=f"aspect-ratio table (ASPECT_RATIO_512, _1024, ...) or HxW ({defaults.buckets})"
    )
    parser.add_argument("--vae", help="local diffusers autoencoder folder, or 'none' (pixel space)")
    parser.add_argument("--text-encoder", help=f"local Gemma-2 / T5 folder, or 'tiny-t5' ({defaults.text_encoder})")
    parser.add_argument(
        "--pretrained", help="a diffusers Sana pipeline folder or Hub id: its vae/ and text_encoder/ are the defaults"
    )
    parser.add_argument(
        "--max-length", type=int, help="caption tokens (default: the config's model.model_max_length, else 300)"
    )
    parser.add_argument(
        "--instruction",
        help="caption prefix for a decoder-only encoder: 'auto' (Sana's for Gemma-2, none for T5), 'none', "
        "the text, or @FILE (default auto)",
    )
    parser.add_argument(
        "--caption-proportion",
        help="caption types and their weights, e.g. 'prompt=1,InternVL2-26B=2' (default prompt=1)",
    )
    parser.add_argument(
        "--caption-suffixes",
        help="comma-separated suffixes of caption side files <stem><suffix>.json (default: only <stem>.json)",
    )
    parser.add_argument("--min-size", type=int, help="skip images whose shorter side is below this (default 0)")
    parser.add_argument("--seed", type=int, help="seed of the caption choice and posterior samples (default 0)")
    parser.add_argument("--posterior", choices=["mode", "sample"], help="a KL VAE's latent (default mode)")
    dtypes = ("float32", "bfloat16", "float16")
    parser.add_argument(
        "--model-dtype", type=dtype_name, choices=dtypes, help=f"encoder weights, {DTYPE_HELP} ({defaults.dtype})"
    )
    parser.add_argument("--feature-dtype", type=dtype_name, choices=dtypes, default="bfloat16", help="stored features")
    parser.add_argument("--batch-size", type=int, default=8, help="images per encoder call")
    parser.add_argument("--shard-size", type=int, default=256, help="samples per shard")
    parser.add_argument("--workers", type=int, help=f"image decoding processes per rank ({defaults.workers})")
    parser.add_argument(
        "--shard-text-encoder",
        action=argparse.BooleanOptionalAction,
        help=f"shard the text encoder over the ranks ({defaults.shard_text_encoder})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output")
    parser.add_argument("--device", default="auto", help="'auto' (this rank's GPU, else CPU), 'cpu', 'cuda:0', ...")
    video = parser.add_argument_group("clips (docs/video.md)")
    video.add_argument("--num-frames", type=int, help="the inputs are clips: frames per clip, 4k+1 (81); 0: images")
    video.add_argument("--fps", type=float, help="the frame rate clips are resampled to (default 16)")
    video.add_argument("--frame-start", choices=START_MODES, help="where a clip's frames start (default first)")
    video.add_argument("--motion-score", choices=MOTION_SCORE_MODES, help="Sana zips' scores (default average)")
    video.add_argument(
        "--vae-tiling", action=argparse.BooleanOptionalAction, help="the Wan VAE encodes frames in tiles"
    )
    values = vars(parser.parse_args(argv))
    if values["instruction"] is not None and values["instruction"].startswith("@"):
        values["instruction"] = Path(values["instruction"][1:]).read_text()
    if values["caption_proportion"] is not None:
        values["caption_proportion"] = _proportion(parser, values["caption_proportion"])
    if values["caption_suffixes"] is not None:
        values["caption_suffixes"] = values["caption_suffixes"].split(",")
    try:
        path = values.pop("config")
        config = load_config(path) if path is not None else None
        flags = {ENCODING_FLAGS[key]: values.pop(key) for key in ENCODING_FLAGS}
        given = {key for key in ("vae", "text_encoder") if flags[key] is not None}  # by their own flags
        pretrained = values.pop("pretrained")
        _pipeline_encoders(parser, pretrained, flags)
        base = config.encoding if config is not None else defaults
        encoding = dataclasses.replace(base, **{key: value for key, value in flags.items() if value is not None})
    except ConfigError as exc:
        parser.error(str(exc))
    if not encoding.vae:
        parser.error("--vae (or the config's encoding.vae) must name a local autoencoder folder, or 'none'")
    _check_encoder_folders(parser, encoding, given, path, pretrained)
    if values["max_length"] is None:
        values["max_length"] = config.caption_length if config is not None else 300
    return PrepareOptions(**values, encoding=encoding)


def _check_encoder_folders(parser, encoding: Encoding, given: set, config: str | None, pretrained) -> None:
    """The VAE and text encoder folders exist and hold what they should (their configs, not their weights) before
    any input is read or a worker starts; a bad one is named by the flag, --config or --pretrained that set it."""

    def origin(key: str) -> str:
        flag = f"--{key.replace('_', '-')}"
        if key in given:
            return flag
        if pretrained:
            return f"--pretrained {pretrained} ({flag})"
        return f"--config {config} (encoding.{key})" if config else f"{flag} (default)"

    try:
        check_text_encoder_name(encoding.text_encoder)
    except FileNotFoundError as exc:
        parser.error(f"{origin('text_encoder')}: {exc}")
    if encoding.vae != "none":
        try:
            autoencoder_class(Path(encoding.vae))
        except (OSError, ValueError) as exc:
            parser.error(f"{origin('vae')}: {exc}")


def _pipeline_encoders(parser, pretrained: str | None, flags: dict) -> None:
    """--vae and --text-encoder from --pretrained's pipeline where the flags do not give them."""
    if not pretrained:
        return
    try:
        defaults = pipeline_defaults(pretrained)
    except ValueError as exc:
        parser.error(f"--pretrained: {exc}")
    for key in ("vae", "text_encoder"):
        if flags[key] is None:
            flags[key] = defaults.get(f"encoding.{key}")


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


class Stopped(BaseException):
    """The ranks agreed to stop (a BaseException, as KeyboardInterrupt: no `except Exception` takes it for a bad
    image). Raised at a batch boundary, never inside a write: the finished shards are kept whole."""


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    rank0 = int(os.environ.get("RANK", 0)) == 0
    # DataLoader workers inherit the handler: it only notes the signal in their copy, which nothing reads
    stop = StopSignal()
    stop.install()
    try:
        summary = prepare(options, stop_signal=stop)
    except Stopped as exc:
        if rank0:
            print(
                f"sana2-prepare: {exc}: stopped; rerun to resume (the finished shards in {options.output} "
                "are kept; the same command encodes the rest)",
                file=sys.stderr,
            )
        return 0
    except (ValueError, FileNotFoundError, NoSpaceError) as exc:
        print(f"sana2-prepare: error: {exc}", file=sys.stderr)
        return USER_ERROR
    finally:
        stop.uninstall()
        # free the sharded encoder (its FSDP state holds the process group) while Python is fully alive:
        # left to interpreter exit, tearing down gloo's threads can abort the process
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank0:
        print("\n".join(summary.lines(Path(options.output))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
