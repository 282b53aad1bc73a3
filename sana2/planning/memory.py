"""Per-rank memory and per-step communication of one training step under FSDP2, from a dry run.

The step is walked through in the order FSDP2 runs it, adding and freeing what each moment holds,
and the peak is the largest total seen. What each moment holds:

- always: this rank's parameter shards (fp32; frozen ones in their dtype), the EMA shards, the optimizer
  state (AdamW: two fp32 moments; CAME: the first moment plus row and column statistics of each matrix),
  the runtime, and in
  online mode the frozen encoders' weights (sana2/planning/encoders.py);
- online mode, before the forward: the text encoder's encode of the micro-batch's captions
  (sana2/planning/text_encode.py), then the VAE's encode of its images or clips (sana2/planning/vae_encode.py);
- forward: the root unit's parameters gathered at the compute dtype (the root is not resharded after
  forward), each block's parameters gathered while it runs, plus the all-gather buffer FSDP keeps
  until the next unit's all-gather (world > 1), every block's saved activations, and one block's
  forward working memory; with reshard_after_forward = false every block stays gathered until its
  backward;
- backward, last block first: the block and the one before it gathered (backward prefetch), the
  block's unsharded gradients at the compute dtype and its backward working memory, then the
  reduce-scatter input at the reduce dtype (kept until the next reduce-scatter) and the gradient
  shard (fp32); the block's activations are freed. With gradient accumulation, micro-batches before
  the last keep every unit's unsharded gradient (reduce dtype) instead of reduce-scattering; the last
  micro-batch's backward frees each unit's when it reduce-scatters it, so the accumulated gradients of
  the units already reduced and their new shards are never both counted (the micro-batch before the
  last is walked too: with 3 or more it holds every unit's accumulated gradient through its backward);
- optimizer step: the gradient shards and the optimizer's temporaries.

Activations come from the calibration (`activations.json`, measured by
benchmarks/calibrate_activations.py): bytes per token x channel, per caption token x channel, ... for
the model's block kind, compute dtype, activation checkpointing mode and batch regime.
With CPU offload, parameter, gradient, optimizer and EMA shards live in host memory; the device
holds the gathered parameters, activations and communication buffers.

Parameters a model transform froze (LoRA's base, sana2/components/lora.py) are sharded and gathered in
their own dtype (the compute dtype) and have no gradient, reduce-scatter, optimizer state or EMA: those
are the trainable parameters' (the adapters'). Their activations are the full model's calibration, an
upper bound (a frozen linear saves no input for its weight's gradient; +11% on a tiny LoRA run).
"""

import math
from dataclasses import dataclass, field, replace

from sana2.planning import context_parallel as cp_costs
from sana2.planning.activations import DTYPE_BYTES, ActivationModel
from sana2.planning.context_parallel import ClipGeometry
from sana2.planning.dry_run import Unit, padded_local_numel, padded_rows
from sana2.planning.encoders import EncoderWeights
from sana2.planning.vae_encode import EncodeCost

GIB = 2**30
# fp32 master weights, gradients, optimizer state and EMA: FSDP2 keeps the sharded parameters in the
# dtype they were built in; mixed precision changes only the gathered copies and the reductions
MASTER_BYTES = 4


@dataclass(frozen=True)
class Setup:
    """Everything the estimate depends on besides the model's units and the activation model."""

    world_size: int
    replicate: int
    shard: int  # the FSDP shard degree: data-parallel shard x context-parallel ranks
    local_batch: int
    gradient_accumulation: int
    tokens: int
    caption_length: int
    latent_elements: int
    param_dtype: str
    reduce_dtype: str
    ac_mode: str  # none | full | selective
    selective_every: int
    reshard_after_forward: bool
    cpu_offload: bool
    optimizer: str  # adamw | came
    ema: bool
    device: str  # cuda | cpu: which runtime and optimizer path (foreach on accelerators)
    runtime_bytes: int  # the process's own memory besides tensors (CUDA context and reserve, or CPU runtime)
    context_parallel: int = 1  # ranks that split one clip's frames
    clip: ClipGeometry | None = None  # a video sample's geometry (None: an image)
    encoders: EncoderWeights | None = None  # online mode's frozen VAE and text encoder (None: precomputed data)
    vae_encode: EncodeCost | None = None  # online mode: what the VAE's encode of a batch holds
    text_encode: EncodeCost | None = None  # online mode: what the text encoder's encode of a batch holds

    @property
    def data_parallel(self) -> int:
        """Ranks the data is split over: the ranks of one cp group read the same samples."""
        return self.world_size // self.context_parallel

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.gradient_accumulation * self.data_parallel

    @property
    def rank_share(self) -> float:
        """The fraction of a sample's tokens the busiest rank holds (1 without context parallelism)."""
        if self.context_parallel == 1 or self.clip is None:
            return 1.0
        return self.clip.rank_frames(self.context_parallel) / self.clip.frames

    @property
    def rank_tokens(self) -> int:
        """Tokens of one sample on one rank: the whole sample, or the busiest rank's frames of it."""
        return round(self.tokens * self.rank_share)

    @property
    def rank_latent_elements(self) -> int:
        return round(self.latent_elements * self.rank_share)


PARTS = (
    "parameters",  # parameter shards (fp32)
    "gradients",  # gradient shards (fp32), and fp32 unsharded gradients kept between accumulation steps
    "optimizer",  # optimizer state shards (fp32)
    "ema",  # EMA shards (fp32)
    "gathered",  # parameters gathered at the compute dtype (root and blocks)
    "activations",  # saved activations, the loss's inputs, and the gradient flowing between blocks
    "working",  # what a block's forward or backward, the loss's backward or the optimizer's update uses on top
    "buffers",  # all-gather outputs, unsharded gradients and reduce-scatter inputs of FSDP
    "encoders",  # online mode's frozen VAE encoder and text encoder (or this rank's shards of it)
    "encoding",  # online mode: the encoders' live tensors while they encode a micro-batch (before its forward)
    "runtime",  # the process's own memory (CUDA context, allocator reserve; or the CPU runtime)
)


@dataclass
class Moment:
    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Estimate:
    """Device bytes per rank at each moment of a step, the peak, and bytes each rank sends per step."""

    setup: Setup
    moments: list[Moment]
    sizes: dict[str, int]  # each part at its own largest (what it costs whenever it is there)
    host: int  # host bytes per rank holding offloaded shards (0 without CPU offload)
    all_gather: int
    reduce_scatter: int
    all_reduce: int
    activations_by_mode: dict[str, int] = field(default_factory=dict)  # saved activations per AC mode
    context_parallel: int = 0  # bytes sent for the attention sums and the temporal halos

    @property
    def peak_moment(self) -> Moment:
        return max(self.moments, key=lambda m: m.total)

    @property
    def peak(self) -> int:
        return self.peak_moment.total


def optimizer_state_numel(units: list[Unit], shard: int, optimizer: str) -> int:
    """Elements of optimizer state on one rank (fp32), for the trainable parameters."""
    total = 0
    for unit in units:
        for p in (p for p in unit.params if p.trainable):
            local = padded_local_numel(p.shape, shard)
            if optimizer == "adamw":
                total += 2 * local  # exp_avg, exp_avg_sq
            elif len(p.shape) >= 2:  # CAME: exp_avg, and row (sharded) + column (replicated) statistics x 2
                total += local + 2 * (padded_rows(p.shape, shard) + math.prod(p.shape[1:]))
            else:
                total += 2 * local  # CAME on a vector: exp_avg, exp_avg_sq
    return total


def shard_numel(unit: Unit, shard: int) -> int:
    """This rank's padded shard of a unit's trainable parameters: its gradient shards, EMA copies."""
    return unit.trainable_padded_numel(shard) // shard


def largest_param_numel(units: list[Unit], shard: int) -> int:
    return max((padded_local_numel(p.shape, shard) for u in units for p in u.params if p.trainable), default=0)


def checkpointed(setup: Setup, index: int) -> bool:
    """Whether block `index` recomputes its activations in backward (as parallelize applies AC)."""
    return setup.ac_mode == "full" or (setup.ac_mode == "selective" and index % setup.selective_every == 0)


def estimate(units: list[Unit], activations: ActivationModel, setup: Setup) -> Estimate:
    """Walk one optimizer step (the last micro-batch of it) and record what each moment holds."""
    root, blocks = units[0], units[1:]
    shard = setup.shard
    pd, rd = DTYPE_BYTES[setup.param_dtype], DTYPE_BYTES[setup.reduce_dtype]
    shard_total = sum(shard_numel(u, shard) for u in units)

    def gathered(unit: Unit) -> int:
        return unit.padded_numel(shard) * pd

    sizes = {
        "parameters": sum(u.shard_bytes(shard) for u in units),  # fp32; a LoRA run's frozen base in its dtype
        "gradients": MASTER_BYTES * shard_total,
        "optimizer": MASTER_BYTES * optimizer_state_numel(units, shard, setup.optimizer),
        "ema": MASTER_BYTES * shard_total if setup.ema else 0,
    }
    # offloaded shards live in host memory; on a CPU run, host and device are the same memory
    on_device = 0 if setup.cpu_offload and setup.device != "cpu" else 1
    host = (sizes["parameters"] + sizes["gradients"] + sizes["optimizer"] + sizes["ema"]) * (1 - on_device)
    # gradient accumulation: micro-batches before the last leave every unit's unsharded gradient, in the
    # reduce dtype (FSDP2's unsharded_accumulated_grad), until the last one's backward reduce-scatters it
    accumulating = setup.gradient_accumulation > 1
    accumulated = {u.name: rd * u.trainable_padded_numel(shard) if accumulating else 0 for u in units}
    all_accumulated = sum(accumulated.values())
    act = activations.for_setup(setup)
    # context parallelism: the sums' and halos' buffers while a block runs, the halo frames it saves
    cp, clip = setup.context_parallel, setup.clip
    cp_buffers = cp_costs.buffer_bytes(clip, cp, setup.local_batch, pd) if clip else 0
    cp_halo = cp_costs.retained_halo_bytes(clip, cp, setup.local_batch, pd) if clip else 0
    moments: list[Moment] = []

    def moment(name, **parts):
        fixed = {
            "parameters": sizes["parameters"] * on_device,
            "optimizer": sizes["optimizer"] * on_device,
            "ema": sizes["ema"] * on_device,
            "encoders": setup.encoders.per_rank(setup.data_parallel) if setup.encoders else 0,
            "runtime": setup.runtime_bytes,
        }
        merged = {part: 0 for part in PARTS} | fixed
        for part, value in parts.items():
            merged[part] += value
        moments.append(Moment(name, merged))

    # -- online mode: the micro-batch is encoded before its forward (the accumulated gradients are there)
    if setup.text_encode is not None:
        encoding = setup.text_encode.at(setup.local_batch)
        moment("text encoder encode of the micro-batch", gradients=all_accumulated, encoding=encoding)
    if setup.vae_encode is not None:
        encoding = setup.vae_encode.at(setup.local_batch)
        moment("VAE encode of the micro-batch", gradients=all_accumulated, encoding=encoding)

    # -- forward: the root stays gathered; each block is gathered while it runs
    saved = act.stem_retained
    kept = gathered(root)  # gathered units that stay gathered until their backward
    buffer = 0  # the previous unit's all-gather output, freed by the next all-gather
    for index, block in enumerate(blocks):
        block_act = act.block(checkpointed(setup, index))
        new_buffer = gathered(block) if setup.world_size > 1 else 0
        halo = 0 if checkpointed(setup, index) else cp_halo
        moment(
            f"forward of block {index}",
            gradients=all_accumulated,
            gathered=kept + gathered(block),
            activations=saved + block_act.retained + halo,
            working=block_act.forward_extra,
            buffers=new_buffer + cp_buffers,
        )
        saved += block_act.retained + halo
        if not setup.reshard_after_forward or index == len(blocks) - 1:
            kept += gathered(block)
        buffer = new_buffer
    saved += act.head_retained
    moment(
        "loss and final layer backward",
        gradients=all_accumulated,
        gathered=kept,
        activations=saved,
        working=act.head_backward_extra,
        buffers=buffer,
    )
    saved -= act.head_retained  # the final layer's and the loss's saved tensors are freed by their backward

    # -- backward, last block first: the block and the one before it (prefetched) are gathered
    def backward(label: str, held: int, reduce: bool) -> int:
        """One micro-batch's backward; `held`: accumulated gradients at its start. Returns the gradient shards.

        Accumulating (not `reduce`), each block's fresh gradient joins the accumulated ones; on the last
        micro-batch each block's accumulated gradient is reduce-scattered and freed by its post-backward."""
        grad_shards = 0
        rs_buffer = 0  # the previous unit's reduce-scatter input, kept until the next reduce-scatter
        live, still_kept = saved, kept
        for index in reversed(range(len(blocks))):
            block = blocks[index]
            block_act = act.block(checkpointed(setup, index))
            stays = not setup.reshard_after_forward or index == len(blocks) - 1
            regathered = 0 if stays else gathered(block)
            prefetched = gathered(blocks[index - 1]) if index > 0 and setup.reshard_after_forward else 0
            moment(
                f"backward of block {index}{label}",
                gradients=held + grad_shards,
                gathered=still_kept + regathered + prefetched,
                activations=live + act.flowing_grad,
                working=block_act.backward_extra,
                buffers=block.trainable_padded_numel(shard) * pd + rs_buffer + cp_buffers,
            )
            live -= block_act.retained + (0 if checkpointed(setup, index) else cp_halo)
            still_kept -= gathered(block) if stays else 0
            if reduce:
                held -= accumulated[block.name]
                rs_buffer = block.trainable_padded_numel(shard) * rd
                grad_shards += MASTER_BYTES * shard_numel(block, shard) * on_device
            elif setup.gradient_accumulation == 2:  # the first micro-batch: the accumulated gradients appear
                held += accumulated[block.name]
        moment(
            f"backward of the embedders and final layer{label}",
            gradients=held + grad_shards,
            gathered=still_kept,
            activations=live + act.flowing_grad,
            buffers=root.trainable_padded_numel(shard) * (pd + (rd if reduce else 0)),
        )
        return grad_shards + (MASTER_BYTES * shard_numel(root, shard) * on_device if reduce else 0)

    if setup.gradient_accumulation > 1:  # the micro-batch before the last: middle ones hold every unit's
        full = all_accumulated if setup.gradient_accumulation > 2 else 0
        backward(f" (micro-batch {setup.gradient_accumulation - 1} of {setup.gradient_accumulation})", full, False)
    grad_shards = backward("", all_accumulated, True)

    # -- optimizer step: gradient shards plus the update's temporaries (on the host when offloaded)
    if setup.device == "cpu" or setup.optimizer == "came":
        temporaries = 4 * MASTER_BYTES * largest_param_numel(units, shard)  # one parameter at a time
    else:
        temporaries = MASTER_BYTES * shard_total  # foreach AdamW: one fp32 list the size of all shards
    moment("optimizer step", gradients=grad_shards, working=temporaries * on_device)

    # the gradients at their largest: the shards (on the host when offloaded), or the accumulated unsharded ones
    sizes["gradients"] = max(sizes["gradients"], *(m.parts["gradients"] for m in moments))
    sizes["gathered"] = max(m.parts["gathered"] for m in moments)
    sizes["activations"] = max(m.parts["activations"] for m in moments)
    by_mode = {}
    for mode in ("none", "full"):
        other = activations.for_setup(replace(setup, ac_mode=mode))
        by_mode[mode] = other.saved(len(blocks), lambda i, mode=mode: mode == "full")
    return Estimate(
        setup=setup,
        moments=moments,
        sizes=sizes,
        host=host,
        all_gather=all_gather_bytes(units, setup),
        reduce_scatter=reduce_scatter_bytes(units, setup),
        all_reduce=all_reduce_bytes(units, setup),
        activations_by_mode=by_mode,
        context_parallel=context_parallel_bytes(setup, len(blocks)),
    )


def context_parallel_bytes(setup: Setup, depth: int) -> int:
    """Bytes one rank sends per optimizer step for context parallelism (every micro-batch)."""
    if setup.clip is None:
        return 0
    recomputed = sum(1 for i in range(depth) if checkpointed(setup, i))
    pd = DTYPE_BYTES[setup.param_dtype]
    per_micro_batch = cp_costs.bytes_sent(setup.clip, setup.context_parallel, setup.local_batch, pd, recomputed)
    return per_micro_batch * setup.gradient_accumulation


def all_gather_bytes(units: list[Unit], setup: Setup) -> int:
    """Bytes one rank sends in all-gathers per optimizer step (ring: (n - 1) / n of each gathered unit).

    Every micro-batch gathers each unit for forward, and again for backward the blocks resharded
    after forward (all but the last; none with reshard_after_forward = false)."""
    n = setup.shard
    pd = DTYPE_BYTES[setup.param_dtype]
    blocks = units[1:]
    per_pass = sum(u.padded_numel(n) for u in units)
    regathered = sum(b.padded_numel(n) for b in blocks[:-1]) if setup.reshard_after_forward else 0
    return (per_pass + regathered) * pd * (n - 1) // n * setup.gradient_accumulation


def reduce_scatter_bytes(units: list[Unit], setup: Setup) -> int:
    """Bytes one rank sends in reduce-scatters per optimizer step (the last micro-batch only)."""
    n = setup.shard
    return sum(u.trainable_padded_numel(n) for u in units) * DTYPE_BYTES[setup.reduce_dtype] * (n - 1) // n


def all_reduce_bytes(units: list[Unit], setup: Setup) -> int:
    """HSDP: bytes one rank sends all-reducing its gradient shards across replicas (ring: 2 (r - 1) / r)."""
    r = setup.replicate
    shard_total = sum(shard_numel(u, setup.shard) for u in units)
    return shard_total * DTYPE_BYTES[setup.reduce_dtype] * 2 * (r - 1) // r
