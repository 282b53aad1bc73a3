"""What fits instead: the smallest single changes to a setup that bring its planned peak under a memory budget
(`sana2-plan`'s suggestions), and the largest local batch that fits.

Each candidate is a whole `Setup` walked through `estimate` again; the global batch is kept where the config
fixes it (more micro-batches for a smaller local batch or more context-parallel ranks, fewer for a larger one).
"""

from dataclasses import dataclass, replace

from sana2.planning.activations import CalibrationMissing
from sana2.planning.dry_run import Unit
from sana2.planning.memory import GIB, Estimate, Setup, estimate

# on CUDA, what a process holds besides its tensors: the CUDA context, cuBLAS and NCCL workspaces and
# the caching allocator's slack. An assumption until benchmarks/gpu_check.sh measures it on a GPU.
CUDA_RUNTIME_BYTES = int(1.5 * GIB)
MAX_WORLD_SIZE = 1024
# the plan counts live tensors (plus the runtime); the allocator holds more. Measured on CPU with glibc
# malloc's defaults, peak RSS was 12% to 35% above the prediction (benchmarks/bench_memory_plan.py's
# "RSS, glibc defaults" column; 2% with MALLOC_MMAP_THRESHOLD_=131072). On CUDA the caching allocator's
# fragmentation plays the same part (torch.cuda.memory_reserved above max_memory_allocated).
ALLOCATOR_SLACK = (0.12, 0.35)


@dataclass
class Suggestion:
    change: str  # what to change, as overrides or launch variables
    estimate: Estimate


def runtime_bytes(device: str, world_size: int, calibration: dict) -> int:
    if device == "cuda":
        return CUDA_RUNTIME_BYTES
    measured = {int(n): b for n, b in calibration.get("cpu_runtime_bytes", {}).items()}
    if not measured:
        raise CalibrationMissing("no CPU runtime in the calibration: run benchmarks/calibrate_activations.py")
    below = [n for n in measured if n <= world_size]
    return measured[max(below) if below else min(measured)]


def context_parallel_options(setup: Setup, fixed_global: bool) -> list[tuple[int, Setup]]:
    """The cp degrees above the configured one that the world and the clip allow, smallest first, each
    with its setup: a fixed global batch is kept by accumulating over more micro-batches."""
    if setup.clip is None:
        return []
    found = []
    degree = setup.context_parallel * 2
    while degree <= min(setup.clip.frames, setup.world_size):
        if setup.world_size % (setup.replicate * degree) == 0:
            accumulation = setup.gradient_accumulation * degree // setup.context_parallel
            found.append(
                (
                    degree,
                    replace(
                        setup,
                        context_parallel=degree,
                        gradient_accumulation=accumulation if fixed_global else setup.gradient_accumulation,
                    ),
                )
            )
        degree *= 2
    return found


# -- what fits instead -------------------------------------------------------------------------------
def _fits(units, activations, setup, memory) -> Estimate | None:
    result = estimate(units, activations, setup)
    return result if result.peak <= memory else None


def less_accumulation(units: list[Unit], activations, setup: Setup, memory: int) -> Suggestion | None:
    """The fewest micro-batches that fit at the same global batch (a larger local batch), if fewer than now.

    Accumulating holds every unit's unsharded gradient through the step: without it a larger local batch
    may fit where the accumulated gradients did not, and fewer, larger micro-batches run faster."""
    per_rank = setup.local_batch * setup.gradient_accumulation
    for steps in (s for s in range(1, setup.gradient_accumulation) if per_rank % s == 0):
        candidate = replace(setup, local_batch=per_rank // steps, gradient_accumulation=steps)
        if (result := _fits(units, activations, candidate, memory)) is not None:
            fewer = f"{steps} micro-batches, not {setup.gradient_accumulation}" if steps > 1 else "no accumulation"
            return Suggestion(
                f"--training.gradient_accumulation_steps={steps} --training.local_batch_size={per_rank // steps} "
                f"(same global batch {setup.global_batch}, {fewer})",
                result,
            )
    return None


def suggest(
    units: list[Unit],
    activations,
    setup: Setup,
    memory: int,
    nproc_per_node: int,
    calibration,
    fixed_global: bool,
    shared_host: bool = False,
) -> list:
    """The single changes that fit, least disruptive first; if none does, checkpointing plus each other.

    `fixed_global`: the config sets training.global_batch_size, so more ranks mean a smaller local batch;
    otherwise the local batch stays and the global batch grows with the ranks. `shared_host`: `memory` is
    each rank's share of a host's (a CPU run), so more ranks come as more hosts of `nproc_per_node`."""
    global_batch = setup.global_batch

    def with_world(base: Setup, world: int) -> Setup | None:
        per_step = world * base.gradient_accumulation
        if (fixed_global and global_batch % per_step) or world % base.replicate:
            return None
        return replace(
            base,
            world_size=world,
            shard=world // base.replicate,
            local_batch=global_batch // per_step if fixed_global else base.local_batch,
            runtime_bytes=runtime_bytes(base.device, world, calibration),
        )

    def options(base: Setup, prefix: str = "") -> list[Suggestion]:
        found = []
        # a clip too large for one rank: split its frames over cp ranks, the smallest degrees first
        for degree, candidate in context_parallel_options(base, fixed_global):
            if (result := _fits(units, activations, candidate, memory)) is not None:
                accumulation = (
                    f" --training.gradient_accumulation_steps={candidate.gradient_accumulation}"
                    if candidate.gradient_accumulation != base.gradient_accumulation
                    else ""
                )
                found.append(
                    Suggestion(
                        prefix + f"--parallelism.context_parallel_degree={degree}{accumulation} ("
                        f"{candidate.world_size // degree} data-parallel ranks, global batch {candidate.global_batch})",
                        result,
                    )
                )
        if base.ac_mode != "full":  # the least checkpointing that fits
            tries = [replace(base, ac_mode="selective", selective_every=k) for k in (4, 3, 2)]
            for candidate in [*tries, replace(base, ac_mode="full")]:
                if (result := _fits(units, activations, candidate, memory)) is not None:
                    change = (
                        "--activation_checkpoint.mode=full"
                        if candidate.ac_mode == "full"
                        else (
                            f"--activation_checkpoint.mode=selective --activation_checkpoint.selective_every="
                            f"{candidate.selective_every}"
                        )
                    )
                    found.append(Suggestion(prefix + change, result))
                    break
        if (fewer := less_accumulation(units, activations, base, memory)) is not None:
            found.append(Suggestion(prefix + fewer.change, fewer.estimate))
        per_rank = base.local_batch * base.gradient_accumulation
        for local in sorted((d for d in range(1, base.local_batch) if per_rank % d == 0), reverse=True):
            candidate = replace(base, local_batch=local, gradient_accumulation=per_rank // local)
            if (result := _fits(units, activations, candidate, memory)) is not None:
                found.append(
                    Suggestion(
                        prefix + f"--training.gradient_accumulation_steps={per_rank // local} "
                        f"--training.local_batch_size={local} (same global batch {global_batch})",
                        result,
                    )
                )
                break
        if not base.cpu_offload:
            candidate = replace(base, cpu_offload=True)
            if (result := _fits(units, activations, candidate, memory)) is not None:
                found.append(
                    Suggestion(
                        prefix + f"--parallelism.cpu_offload=true (host memory per rank: {result.host / GIB:.1f} GiB)",
                        result,
                    )
                )
        world = base.world_size * 2
        while world <= MAX_WORLD_SIZE:
            candidate = with_world(base, world)
            if candidate and (result := _fits(units, activations, candidate, memory)) is not None:
                per_node = nproc_per_node if nproc_per_node > 1 or shared_host else min(world, 8)
                launch = f"NGPU={world}" if world == per_node else f"NNODES={world // per_node} x NGPU={per_node}"
                found.append(
                    Suggestion(
                        prefix + f"{world} ranks ({launch}; local batch {candidate.local_batch}, "
                        f"global batch {candidate.global_batch})",
                        result,
                    )
                )
                break
            world *= 2
        return found

    found = options(setup)
    if not found and setup.ac_mode != "full":
        found = options(replace(setup, ac_mode="full"), prefix="--activation_checkpoint.mode=full and ")
    if not found:
        base = replace(setup, ac_mode="full", cpu_offload=True)
        found = options(base, prefix="--activation_checkpoint.mode=full, --parallelism.cpu_offload=true and ")
    return found


def largest_local_batch(units: list[Unit], activations, setup: Setup, memory: int, limit: int = 1 << 16) -> int:
    """The largest local batch that fits without gradient accumulation (0: not even one sample)."""

    def fits(batch: int) -> bool:
        candidate = replace(setup, local_batch=batch, gradient_accumulation=1)
        return _fits(units, activations, candidate, memory) is not None

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
