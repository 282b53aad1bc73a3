"""Will it fit? Per-rank memory and per-step communication of a training config on N GPUs, before renting them.

    python -m sana2.plan CONFIG [--section.key=value ...] --nproc-per-node 8 [--nnodes 2] --gpu-memory 80
    ./run_train.sh --plan --gpu-memory 80 [...]          (NGPU, NNODES, CONFIG_FILE as for training)

The config's model is built on the meta device and parallelised for the whole world in this one
process over a fake process group (sana2/planning/dry_run.py); memory is walked through one step
(sana2/planning/memory.py) with activations from a measured model (sana2/planning/activations.py).
It prints what each rank holds at its peak, the verdict against the GPU's memory, and when it does not
fit, the smallest changes that do: activation checkpointing, a smaller local batch (with gradient
accumulation to keep the global batch), CPU offload, more ranks.
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from sana2.cli import USER_ERROR
from sana2.config import ConfigError, JobConfig, load_config
from sana2.data.buckets import parse_buckets
from sana2.data.features import META_FILE, DataFormatError, FeatureDataset
from sana2.distributed.context_parallel import ContextParallelError, check_model
from sana2.formats.pipeline import pipeline_defaults
from sana2.planning.activations import ActivationModel, CalibrationMissing, load_calibration
from sana2.planning.calibration import model_shape
from sana2.planning.context_parallel import ClipGeometry
from sana2.planning.dry_run import DryRun, dry_run
from sana2.planning.encoders import EncoderWeights, online_encoder_weights
from sana2.planning.memory import GIB, PARTS, Estimate, Setup, estimate
from sana2.planning.suggestions import (
    ALLOCATOR_SLACK,
    MAX_WORLD_SIZE,
    Suggestion,
    largest_local_batch,
    less_accumulation,
    runtime_bytes,
    suggest,
)
from sana2.planning.text_encode import text_encode_cost
from sana2.planning.vae_encode import EncodeCost, vae_encode_cost

# Sana's VAEs: DC-AE f32c32 for images; Wan 2.1 (4x in time, 8x in space) for video
IMAGE_VAE_STRIDE = 32
VIDEO_VAE_STRIDE = (4, 8, 8)


@dataclass(frozen=True)
class SampleShape:
    """One training sample's shape, and where it was read from."""

    latent_shape: tuple[int, ...]
    caption_length: int
    source: str
    caption_dim: int | None = None  # known from a dataset's meta.json; else the model's caption_channels
    pixels: tuple[int, int] | None = None  # online mode with a VAE: the height and width it encodes
    frames: int | None = None  # ... and the frames of a clip (None: images)


@dataclass
class MemoryPlan:
    """What `sana2-plan` reports for a config on N GPUs: the estimate, the verdict and the suggestions
    (not to be confused with sana2/data/dataset_plan.py's DatasetPlan, the data manifest)."""

    config: JobConfig
    dry: DryRun
    sample: SampleShape
    kind: str
    estimate: Estimate
    memory_bytes: int | None  # the GPU's memory (the host's for --device cpu); None: no verdict
    nnodes: int
    suggestions: list[Suggestion]
    max_local_batch: int | None  # the largest local batch that fits as configured (None: no memory given)
    sharing: int = 1  # ranks that share memory_bytes: a GPU is one rank's, a CPU host its node's ranks'
    less_accumulation: Suggestion | None = None  # fewer micro-batches at the same global batch that also fit

    @property
    def budget(self) -> int | None:
        """The memory one rank may use: the GPU's, or its share of the host's."""
        return None if self.memory_bytes is None else self.memory_bytes // self.sharing

    @property
    def fits(self) -> bool | None:
        return None if self.memory_bytes is None else self.estimate.peak * self.sharing <= self.memory_bytes


# -- the sample ------------------------------------------------------------------------------------
def sample_shape(config: JobConfig, model, latent_shape=None, resolution=None, frames=None) -> SampleShape:
    """The latent shape: given, or from the resolution, or from the data (online: its largest bucket; a
    dataset: its meta.json, the largest bucket's), or the model's input_size."""
    in_channels, video = model.in_channels, len(model.patch_size) == 3
    caption_length = config.caption_length
    if latent_shape:
        return SampleShape(tuple(latent_shape), caption_length, "--latent-shape")
    if resolution:
        height, width = resolution
        stride = VIDEO_VAE_STRIDE[1] if video else IMAGE_VAE_STRIDE
        if height < stride or width < stride:
            vae = "the Wan VAE's 8" if video else "DC-AE's 32"
            raise ConfigError(
                f"--resolution {height}x{width} gives no latent tokens: {vae} pixels per latent side need at "
                f"least {stride}x{stride}"
            )
        if video:
            t = VIDEO_VAE_STRIDE[0]
            if frames < 1 or (frames - 1) % t:
                raise ConfigError(f"--num-frames {frames}: the Wan VAE takes {t}k + 1 frames (1, 5, ..., 81)")
            shape = (in_channels, (frames - 1) // t + 1, height // stride, width // stride)
            return SampleShape(shape, caption_length, f"{height}x{width}, {frames} frames (Wan VAE 4x8x8)")
        shape = (in_channels, height // stride, width // stride)
        return SampleShape(shape, caption_length, f"{height}x{width} (DC-AE f32)")
    if config.data.mode == "online":
        # the largest of the buckets the step encodes images into: the most tokens, the most memory
        bucket = max(parse_buckets(config.encoding.buckets), key=lambda b: b.height * b.width)
        where = f"online, encoding.buckets {config.encoding.buckets}: largest bucket {bucket.height}x{bucket.width}"
        frames = config.encoding.num_frames
        if config.encoding.vae == "none":  # pixels in [-1, 1] are the latents
            shape = (3, frames, bucket.height, bucket.width) if frames else (3, bucket.height, bucket.width)
            return SampleShape(shape, caption_length, f"{where} (pixels)")
        pixels = (bucket.height, bucket.width)
        if frames:  # clips through the Wan VAE
            t, s = VIDEO_VAE_STRIDE[0], VIDEO_VAE_STRIDE[1]
            shape = (in_channels, (frames - 1) // t + 1, bucket.height // s, bucket.width // s)
            where += f", {frames} frames (Wan VAE 4x8x8)"
            return SampleShape(shape, caption_length, where, pixels=pixels, frames=frames)
        shape = (in_channels, bucket.height // IMAGE_VAE_STRIDE, bucket.width // IMAGE_VAE_STRIDE)
        return SampleShape(shape, caption_length, f"{where} (DC-AE f32)", pixels=pixels)
    if config.data.path != "digits" and (Path(config.data.path) / META_FILE).is_file():
        try:
            data = FeatureDataset(config.data.path)
        except DataFormatError as exc:
            raise ConfigError(f"{config.source}: data.path: {exc}") from None
        # with aspect-ratio buckets, the one with the most tokens sets the peak
        index = max(range(len(data.buckets)), key=lambda i: math.prod(data.latent_shapes[i]))
        where = str(Path(config.data.path) / META_FILE)
        if len(data.buckets) > 1:
            where += f", largest of {len(data.buckets)} buckets ({data.buckets[index]['name']})"
        return SampleShape(data.latent_shapes[index], data.caption_length, where, data.caption_dim)
    if video:
        raise ConfigError(
            f"{config.source}: the video model's frames and size are not in the config: give "
            "--resolution HxW --num-frames F or --latent-shape C,F,H,W"
        )
    side = model.input_size
    return SampleShape((in_channels, side, side), caption_length, f"[model] input_size = {side}")


# -- the setup -------------------------------------------------------------------------------------
def make_setup(config: JobConfig, dry: DryRun, sample: SampleShape, device: str, calibration: dict) -> Setup:
    t, p = config.training, config.parallelism
    caption_dim = sample.caption_dim or dry.model.caption_shape[1]
    try:  # the trainer's own check of model against data
        dry.model.check_fits(sample.latent_shape, (sample.caption_length, caption_dim))
    except ValueError as exc:
        raise ConfigError(f"{config.source}: [model] does not fit the sample ({sample.source}): {exc}") from None
    shape = model_shape(dry.model, dry.local_batch, sample.latent_shape, sample.caption_length)
    clip = ClipGeometry.of(dry.model, sample.latent_shape)
    cp = p.context_parallel_degree
    if cp > 1:
        try:
            check_model(dry.model)
        except ContextParallelError as exc:
            raise ConfigError(f"{config.source}: parallelism.context_parallel_degree = {cp}: {exc}") from None
        if clip.frames < cp:
            raise ConfigError(
                f"{config.source}: parallelism.context_parallel_degree = {cp} exceeds the sample's "
                f"{clip.frames} latent frames ({sample.source})"
            )
    return Setup(
        world_size=dry.world_size,
        replicate=dry.replicate,
        shard=dry.shard,
        local_batch=dry.local_batch,
        gradient_accumulation=t.gradient_accumulation_steps,
        tokens=shape["tokens"],
        caption_length=sample.caption_length,
        latent_elements=shape["latent_elements"],
        param_dtype=t.mixed_precision_param,
        reduce_dtype=t.mixed_precision_reduce,
        ac_mode=config.activation_checkpoint.mode,
        selective_every=config.activation_checkpoint.selective_every,
        reshard_after_forward=p.reshard_after_forward,
        cpu_offload=p.cpu_offload,
        optimizer=config.optimizer.name,
        ema=t.ema_decay > 0,
        device=device,
        runtime_bytes=runtime_bytes(device, dry.world_size, calibration),
        context_parallel=cp,
        clip=clip,
        encoders=encoder_weights(config) if config.data.mode == "online" else None,
        vae_encode=vae_encode(config, sample),
        text_encode=text_encode(config, sample, dry.world_size // cp),
    )


def encoder_weights(config: JobConfig) -> EncoderWeights:
    """Online mode's VAE and text encoder weights, from their folders' config.json."""
    try:
        return online_encoder_weights(config.encoding)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{config.source}: [encoding]: {exc}") from None


def vae_encode(config: JobConfig, sample: SampleShape) -> EncodeCost | None:
    """Online mode: what the VAE's encode of a micro-batch holds, run on the meta device from its config."""
    if config.data.mode != "online" or sample.pixels is None:
        return None
    try:
        return vae_encode_cost(config.encoding, *sample.pixels, sample.frames)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{config.source}: [encoding] vae: {exc}") from None


def text_encode(config: JobConfig, sample: SampleShape, data_parallel: int) -> EncodeCost | None:
    """Online mode: what the text encoder's encode of a micro-batch's captions holds, run on the meta device."""
    if config.data.mode != "online":
        return None
    try:
        return text_encode_cost(config.encoding, sample.caption_length, data_parallel)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{config.source}: [encoding] text_encoder: {exc}") from None


# -- the plan --------------------------------------------------------------------------------------
def make_memory_plan(
    config: JobConfig,
    nproc_per_node: int,
    nnodes: int = 1,
    device: str = "cuda",
    memory_gib: float | None = None,
    latent_shape=None,
    resolution=None,
    frames: int = 81,
    calibration: dict | None = None,
) -> MemoryPlan:
    calibration = load_calibration() if calibration is None else calibration
    world_size = nproc_per_node * nnodes
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(f"world size {world_size} is outside 1..{MAX_WORLD_SIZE}")
    dry = dry_run(config, world_size)
    sample = sample_shape(config, dry.model, latent_shape, resolution, frames)
    activations = ActivationModel(dry.model, calibration)
    setup = make_setup(config, dry, sample, device, calibration)
    result = estimate(dry.units, activations, setup)
    memory = None if memory_gib is None else int(memory_gib * GIB)
    sharing = nproc_per_node if device == "cpu" else 1  # a CPU host's ranks share its memory
    suggestions, max_batch, less = [], None, None
    if memory is not None:
        budget = memory // sharing
        max_batch = largest_local_batch(dry.units, activations, setup, budget)
        fixed_global = config.training.global_batch_size > 0
        if result.peak > budget:
            suggestions = suggest(
                dry.units, activations, setup, budget, nproc_per_node, calibration, fixed_global, device == "cpu"
            )
        else:
            less = less_accumulation(dry.units, activations, setup, budget)
    kind = activations.kind
    return MemoryPlan(config, dry, sample, kind, result, memory, nnodes, suggestions, max_batch, sharing, less)


def describe_encoders(weights: EncoderWeights, data_parallel: int) -> str:
    text = f"text encoder {weights.text_encoder / GIB:.2f} GiB ({weights.text_encoder_dtype}"
    if weights.shard_text_encoder and data_parallel > 1:
        text += f", sharded over {data_parallel} ranks: {weights.text_encoder / data_parallel / GIB:.2f} GiB each)"
    else:
        text += ", whole on every rank)"
    if weights.vae:
        text += f", VAE encoder {weights.vae / GIB:.2f} GiB ({weights.vae_dtype})"
    return text + "; weights from the folders' config.json"


def _gib(value: int) -> str:
    return f"{value / GIB:8.2f}"


def format_plan(plan: MemoryPlan) -> str:
    s, e, dry = plan.estimate.setup, plan.estimate, plan.dry
    params = sum(u.numel for u in dry.units)
    frozen = sum(p.numel for u in dry.units for p in u.params if not p.trainable)
    mesh = " x ".join(f"{d}={n}" for d, n in zip(dry.mesh_dims, dry.mesh_shape))
    sharding = "FSDP" if s.replicate == 1 else "HSDP"
    ac = s.ac_mode if s.ac_mode != "selective" else f"selective every {s.selective_every}"
    lines = [
        f"memory plan for {plan.config.source}",
        f"  model    {dry.model_name}: {params:,} parameters, {len(dry.units) - 1} blocks",
        f"           blocks: {plan.kind}",
        f"  sample   latents {'x'.join(map(str, plan.sample.latent_shape))} ({plan.sample.source}) -> "
        f"{s.tokens:,} tokens, {s.caption_length} caption tokens",
        f"  batch    local {s.local_batch} x accumulation {s.gradient_accumulation} x "
        f"{s.data_parallel} data-parallel ranks = global {s.global_batch}",
        f"  ranks    {s.world_size} ({plan.nnodes} node(s) x {s.world_size // plan.nnodes}); {sharding}, mesh {mesh}",
    ]
    if s.context_parallel > 1:
        lines.append(
            f"  context  parallel degree {s.context_parallel}: each rank holds "
            f"{s.clip.rank_frames(s.context_parallel)} of {s.clip.frames} frames, {s.rank_tokens:,} tokens; "
            f"FSDP over data-parallel shard x cp = {s.shard}"
        )
    lines += [
        f"  precision {s.param_dtype} compute, {s.reduce_dtype} reduce; AC {ac}; reshard_after_forward "
        f"{str(s.reshard_after_forward).lower()}; CPU offload {str(s.cpu_offload).lower()}; "
        f"{s.optimizer}{', EMA' if s.ema else ''}; device {s.device}",
        "",
        f"per rank (GiB)                         size   at peak   ({e.peak_moment.name})",
    ]
    labels = {
        "parameters": "parameters (fp32 shards)" if not frozen else "parameters (shards, frozen too)",
        "gradients": "gradients (fp32 shards)",
        "optimizer": f"optimizer state ({s.optimizer})",
        "ema": "EMA (fp32 shards)",
        "gathered": f"gathered parameters ({s.param_dtype})",
        "activations": "activations",
        "working": "working memory (blocks, update)",
        "buffers": "FSDP communication buffers",
        "encoders": "frozen encoders (online mode)",
        "encoding": "encode of a batch (online)",
        "runtime": "runtime (" + ("CUDA context, allocator" if s.device == "cuda" else "CPU process") + ")",
    }
    sizes = {**e.sizes, **{p: max(m.parts[p] for m in e.moments) for p in PARTS if p not in e.sizes}}
    for part in PARTS:
        note = " (on the host)" if s.cpu_offload and part in ("parameters", "gradients", "optimizer", "ema") else ""
        lines.append(f"  {labels[part]:<34s}{_gib(sizes[part])}  {_gib(e.peak_moment.parts[part])}{note}")
    lines.append(f"  {'peak':<34s}{'':8s}  {_gib(e.peak)}")
    by_mode = "   ".join(f"AC {mode}: {value / GIB:.2f}" for mode, value in e.activations_by_mode.items())
    lines.append(f"  saved activations by AC mode (GiB): {by_mode}")
    if s.cpu_offload:
        lines.append(f"  host memory for the offloaded shards: {e.host / GIB:.2f} GiB per rank")
    if s.encoders:
        lines.append("  frozen encoders: " + describe_encoders(s.encoders, s.data_parallel))
    if frozen:
        lines.append(
            f"  frozen   {frozen:,} parameters held in {s.param_dtype} shards (no gradient, optimizer state or EMA); "
            f"{params - frozen:,} trainable ({', '.join(plan.config.model_transforms.names)})"
        )
    if s.text_encode:
        lines.append(
            f"  text encoder encode of a micro-batch of {s.local_batch}: {s.text_encode.at(s.local_batch) / GIB:.2f} "
            f"GiB ({s.text_encode.what}; its live tensors, run on the meta device from its config.json)"
        )
    if s.vae_encode:
        lines.append(
            f"  VAE encode of a micro-batch of {s.local_batch}: {s.vae_encode.at(s.local_batch) / GIB:.2f} GiB "
            f"({s.vae_encode.what}; its live tensors, run on the meta device from the VAE's config.json)"
        )
    lines += [
        "",
        "per optimizer step, sent by each rank (GiB)",
        f"  {f'all-gather ({s.param_dtype})':<34s}{_gib(e.all_gather)}",
        f"  {f'reduce-scatter ({s.reduce_dtype})':<34s}{_gib(e.reduce_scatter)}",
    ]
    if s.replicate > 1:
        lines.append(f"  {f'all-reduce across {s.replicate} replicas':<34s}{_gib(e.all_reduce)}")
    if s.context_parallel > 1:
        lines.append(f"  {'context parallel (sums, halos)':<34s}{_gib(e.context_parallel)}")
    lines.append("")
    low, high = ALLOCATOR_SLACK
    lines.append(
        f"the peak counts live tensors and the runtime; the allocator's slack comes on top (measured on CPU with "
        f"default malloc: RSS {low:.0%} to {high:.0%} above the plan, up to {e.peak * (1 + high) / GIB:.2f} GiB "
        "per rank here): read the verdict with that margin, not as a guarantee"
    )
    if plan.memory_bytes is not None:
        lines.append(
            f"largest local batch that fits without accumulation: {plan.max_local_batch} "
            f"(AC {ac}; {'not even one sample' if plan.max_local_batch == 0 else 'per rank'})"
        )
    if plan.memory_bytes is None:
        lines.append(f"peak {e.peak / GIB:.2f} GiB per rank (give --gpu-memory for a verdict)")
    else:
        if plan.sharing > 1:  # a CPU host's ranks share its memory
            against = (
                f"peak {e.peak / GIB:.2f} GiB per rank x {plan.sharing} ranks on the host = "
                f"{e.peak * plan.sharing / GIB:.2f} GiB of the host's {plan.memory_bytes / GIB:.0f} GiB"
            )
        else:
            against = f"peak {e.peak / GIB:.2f} GiB of {plan.memory_bytes / GIB:.0f} GiB per rank"
        if plan.fits:
            lines.append(f"verdict: FITS: {against}")
            if plan.less_accumulation:
                lines.append(
                    f"also fits with fewer micro-batches (faster steps): {plan.less_accumulation.change}: "
                    f"peak {plan.less_accumulation.estimate.peak / GIB:.2f} GiB"
                )
        else:
            lines.append(f"verdict: DOES NOT FIT: {against}")
            if plan.suggestions:
                lines.append("changes that fit (the first is the smallest):")
                for suggestion in plan.suggestions:
                    lines.append(f"  {suggestion.change}: peak {suggestion.estimate.peak / GIB:.2f} GiB")
            else:
                lines.append(f"nothing up to {MAX_WORLD_SIZE} ranks with checkpointing and offload fits")
    return "\n".join(lines)


def _pair(text: str, sep: str, count: int | None, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.lower().split(sep))
    except ValueError:
        values = ()
    if not values or (count and len(values) != count) or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{what}: expected positive integers separated by {sep!r}, got {text!r}")
    return values


def _positive(convert, expected: str):
    """An argparse type: `convert`'s value of the text, refused unless positive and finite."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_gib = _positive(float, "a positive, finite number of GiB")
_positive_int = _positive(int, "a positive integer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sana2.plan", description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", help="TOML config (default: the debug config's defaults)")
    parser.add_argument("--nproc-per-node", "--ngpu", type=_positive_int, default=1, help="ranks per node (default 1)")
    parser.add_argument("--nnodes", type=_positive_int, default=1)
    parser.add_argument(
        "--gpu-memory",
        type=_positive_gib,
        help="memory per GPU in GiB; with --device cpu the host's, which its --nproc-per-node ranks share",
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--resolution", type=lambda t: _pair(t, "x", 2, "--resolution"), help="pixels HxW")
    parser.add_argument(
        "--num-frames",
        "--frames",
        dest="frames",
        type=_positive_int,
        default=81,
        help="video frames, as sana2-sample and diffusers count them (with --resolution; default 81)",
    )
    parser.add_argument("--latent-shape", type=lambda t: _pair(t, ",", None, "--latent-shape"), help="C,H,W or C,F,H,W")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON")
    args, overrides = parser.parse_known_args(argv)
    try:
        config = load_config(args.config, overrides, pipeline_defaults)
        plan = make_memory_plan(
            config,
            args.nproc_per_node,
            args.nnodes,
            args.device,
            args.gpu_memory,
            args.latent_shape,
            args.resolution,
            args.frames,
        )
    except (ConfigError, CalibrationMissing) as exc:
        print(f"plan error: {exc}", file=sys.stderr)
        return USER_ERROR
    if args.json:
        e = plan.estimate
        print(
            json.dumps(
                {
                    "peak_bytes": e.peak,
                    "peak_moment": e.peak_moment.name,
                    "at_peak": e.peak_moment.parts,
                    "sizes": e.sizes,
                    "fits": plan.fits,
                    "max_local_batch": plan.max_local_batch,
                    "all_gather_bytes": e.all_gather,
                    "reduce_scatter_bytes": e.reduce_scatter,
                    "all_reduce_bytes": e.all_reduce,
                    "context_parallel_degree": e.setup.context_parallel,
                    "rank_tokens": e.setup.rank_tokens,
                    "context_parallel_bytes": e.context_parallel,
                    "suggestions": [{"change": s.change, "peak_bytes": s.estimate.peak} for s in plan.suggestions],
                    "less_accumulation": plan.less_accumulation and plan.less_accumulation.change,
                    "ranks_sharing_memory": plan.sharing,
                    "allocator_slack": list(ALLOCATOR_SLACK),
                },
                indent=1,
            )
        )
    else:
        print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
