"""Apply a config's parallelisation for N ranks in this one process, with no memory and no communication.

The model is built on the meta device and `parallelize_sana` shards it over a mesh of N ranks whose
process group is torch's "fake" backend: a process group that answers every collective without
sending anything (torchtitan's `COMM_MODE=fake_backend` dry run uses the same backend through
`init_process_group("fake", rank=..., world_size=...)`, a public entry point). FSDP2 then lays out
exactly the DTensor shards rank 0 would hold, on meta tensors, so nothing of the model is allocated
and N = 1024 takes seconds. Rank 0 holds the largest shards (FSDP2 pads every rank's shard to
ceil(dim 0 / shard degree) rows), so its numbers are every rank's upper bound.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from sana2.components.model_transforms import apply_transforms, build_transforms
from sana2.config import JobConfig, resolve_batch
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.parallelize import ParallelizeError, parallelize_sana
from sana2.models import build_model


@dataclass
class ShardedParam:
    name: str
    shape: tuple[int, ...]  # the full parameter
    local_shape: tuple[int, ...]  # rank 0's shard
    trainable: bool = True  # False: frozen by a model transform (LoRA's base): no gradient, optimizer state, EMA
    itemsize: int = 4  # bytes per element of the sharded parameter (fp32; LoRA's frozen base: the compute dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass
class Unit:
    """One FSDP unit (a `fully_shard` call): gathered, resharded and reduced together."""

    name: str  # "root" (embedders, final layer) or "blocks.<i>"
    params: list[ShardedParam] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def local_numel(self) -> int:
        return sum(p.local_numel for p in self.params)

    def padded_numel(self, shard: int) -> int:
        """Elements gathered: every rank's padded shard, times the shard degree."""
        return shard * sum(padded_local_numel(p.shape, shard) for p in self.params)

    def trainable_padded_numel(self, shard: int) -> int:
        """Elements with a gradient (unsharded, accumulated, reduce-scattered): the trainable parameters'."""
        return shard * sum(padded_local_numel(p.shape, shard) for p in self.params if p.trainable)

    def shard_bytes(self, shard: int) -> int:
        """Bytes of this rank's parameter shards, each in its own dtype."""
        return sum(padded_local_numel(p.shape, shard) * p.itemsize for p in self.params)


def padded_local_numel(shape: tuple[int, ...], shard: int) -> int:
    return padded_rows(shape, shard) * math.prod(shape[1:])


def padded_rows(shape: tuple[int, ...], shard: int) -> int:
    """Rows of dim 0 each rank's shard occupies: FSDP2 pads dim 0 to a multiple of the shard degree."""
    return math.ceil(shape[0] / shard) if shape else 1


@dataclass
class DryRun:
    """The sharded layout of a model under a config at a world size."""

    model_name: str
    model: nn.Module  # the sharded model on the meta device (its parameters are meta DTensors)
    units: list[Unit]  # root first, then the blocks in order
    world_size: int
    replicate: int
    shard: int
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    local_batch: int  # the trainer's per-rank batch (training.global_batch_size resolved)


@contextmanager
def fake_world(config: JobConfig, world_size: int):
    """Be rank 0 of `world_size` ranks on a fake process group; yields the trainer's ParallelDims for
    `config` (its fsdp mesh: 1-D (dp_shard) for FSDP, 2-D (dp_replicate, dp_shard) for HSDP) and tears the
    group down after.

    Refuses a process that already has a process group (a training process): the fake group must be
    the default group while FSDP shards."""
    if dist.is_initialized():
        raise RuntimeError("the memory plan needs a process of its own: a process group is already initialised")
    dims = ParallelDims.from_config(config, world_size, "cpu")
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield dims
    finally:
        dist.destroy_process_group()


def dry_run(config: JobConfig, world_size: int) -> DryRun:
    """Build `config`'s model on meta and apply its whole parallelisation for `world_size` ranks."""
    local_batch = resolve_batch(config, ParallelDims.from_config(config, world_size).dp_size).local
    with fake_world(config, world_size) as dims:
        with torch.device("meta"):
            model = build_model(config.model.name, **config.model.overrides)
        model = apply_transforms(model, build_transforms(config))
        try:
            parallelize_sana(
                model, dims, config.parallelism, config.training, config.activation_checkpoint, config.compile
            )
        except ParallelizeError as exc:
            raise config.error(str(exc)) from None
        mesh = dims.fsdp_mesh
        replicate = mesh.shape[0] if mesh.ndim == 2 else 1
        return DryRun(
            config.model.name,
            model,
            collect_units(model),
            world_size,
            replicate,
            world_size // replicate,
            tuple(mesh.shape),
            mesh.mesh_dim_names,
            local_batch,
        )


def collect_units(model: nn.Module) -> list[Unit]:
    """The FSDP units of a sharded model, each with the parameters it manages (not its children's)."""
    owner: dict[int, str] = {}
    names: list[str] = []
    for module_name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            names.append(module_name or "root")
            for param in module.parameters():
                owner[id(param)] = module_name or "root"  # nested units overwrite their parent's claim
    units = {name: Unit(name) for name in names}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        sharded = ShardedParam(name, tuple(param.shape), tuple(local.shape), param.requires_grad, param.element_size())
        units[owner[id(param)]].params.append(sharded)
    return [units[name] for name in names]
