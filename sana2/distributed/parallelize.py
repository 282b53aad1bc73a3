"""Apply activation checkpointing, torch.compile and FSDP2 to a Sana model, then place its storage.

The model is built on the meta device; `parallelize_sana` wraps it (allocating nothing, so a memory
plan can run it on a fake process group); `materialize` then allocates this rank's storage where
each piece lives, and sana2/distributed/initialize.py fills it.
"""

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from sana2.config import ActivationCheckpoint, Compile, Parallelism, Training
from sana2.distributed.context_parallel import ContextParallel, ContextParallelError, apply_context_parallel
from sana2.distributed.parallel_dims import ParallelDims


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """fully_shard every transformer block, then the root (which holds embedders and head).

    A 1-D mesh shards fully (FSDP); a 2-D (replicate, shard) mesh shards within a group and
    replicates across groups (HSDP).
    """
    kwargs = {"mesh": mesh}
    if cpu_offload:
        # pinned memory needs an accelerator; a CPU-only build fails with pin_memory=True
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # The root casts the model's inputs to the compute dtype; what blocks receive is computed under it
    # already, except the video model's rotary angles, which must stay float64 (a bf16 angle of a
    # position in the hundreds is off by radians), so blocks do not cast their inputs again.
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for index, block in enumerate(model.blocks):
        # the last block's parameters are needed again at once by the root's backward
        last = index == len(model.blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, mp_policy=block_policy, **kwargs)
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=root_policy, **kwargs)
    return model


def apply_activation_checkpointing(model: nn.Module, mode: str, selective_every: int = 2) -> None:
    """mode "full": recompute every block in backward; "selective": every `selective_every`-th block.

    The composable `checkpoint` hooks into the block instead of wrapping it, so parameter names (and
    with them checkpoints and the name-seeded initialisation) stay those of the plain model.
    """
    if mode == "none":
        return
    for index, block in enumerate(model.blocks):
        if mode == "full" or index % selective_every == 0:
            checkpoint(block)


def apply_compile(model: nn.Module) -> None:
    """Compile each block on its own (blocks repeat, so one compiled graph serves all)."""
    for block in model.blocks:
        block.compile()


class ParallelizeError(ValueError):
    """A setting parallelize_sana cannot apply, named by its config key (the caller adds the file)."""


def parallelize_sana(
    model: nn.Module,
    dims: ParallelDims,
    parallelism: Parallelism,
    training: Training,
    activation_checkpoint: ActivationCheckpoint,
    compile: Compile,
    cp: ContextParallel | None = None,
) -> nn.Module:
    """The whole parallelisation of a Sana DiT from its config sections: AC, then context parallelism's
    hooks (with `cp`, the cp group of this rank), then compile, then FSDP2 over the fsdp mesh of `dims`
    (which spans the data-parallel shard and cp ranks); `training` gives the mixed-precision dtypes."""
    apply_activation_checkpointing(model, activation_checkpoint.mode, activation_checkpoint.selective_every)
    if cp is not None:
        if compile.enable:  # the hooks' collectives inside compiled blocks are not tested yet
            raise ParallelizeError("parallelism.context_parallel_degree > 1 and compile.enable = true: turn one off")
        try:
            apply_context_parallel(model, cp)
        except ContextParallelError as exc:
            raise ParallelizeError(f"parallelism.context_parallel_degree = {cp.degree}: {exc}") from None
    if compile.enable:
        apply_compile(model)
    return apply_fsdp(
        model,
        dims.fsdp_mesh,
        param_dtype=getattr(torch, training.mixed_precision_param),
        reduce_dtype=getattr(torch, training.mixed_precision_reduce),
        reshard_after_forward=parallelism.reshard_after_forward,
        cpu_offload=parallelism.cpu_offload,
    )


def materialize(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> nn.Module:
    """Allocate this rank's (uninitialised) parameter shards and the buffers.

    With CPU offload the shards live on the CPU and FSDP moves them to `device` for each block's
    compute; FSDP moves parameters only, so the buffers (the null caption, pos_embed) are put on
    `device` here, where the forward reads them.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(name, buffer.to(device))
    return model
