"""A frozen model sharded over the data-parallel ranks: each rank keeps 1/N of its weights.

Sana's trainer wraps its frozen text encoder in FSDP layer by layer so that no rank holds all of it.
Here: `fully_shard` on every layer of the encoder's layer list and on the root, over a 1-D mesh, with
parameters frozen (requires_grad False) in one dtype (bf16 by default). A forward all-gathers one layer
at a time and frees it afterwards, so the full weights never sit on a rank; the model belongs to no
optimizer and no checkpoint. Every rank of the mesh must run the same number of forwards (each one is a
sequence of collectives), even a rank with nothing to encode.
"""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard


def layer_list(model: nn.Module) -> nn.ModuleList:
    """The model's stack of layers: the ModuleList holding the most parameters (T5 `encoder.block`,
    Gemma-2 `layers`)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of layers to shard")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def shard_frozen_encoder(model: nn.Module, mesh: DeviceMesh, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Freeze `model`, cast its parameters to `dtype` and shard it per layer over the 1-D `mesh` (in place).

    `model` may be on the meta device (then `to_empty` it and fill the local shards) or materialised.
    """
    if mesh.ndim != 1:
        raise ValueError(f"the frozen encoder shards over a 1-D mesh, got {mesh.ndim} dimensions")
    with torch.no_grad():
        for param in model.parameters():  # parameters only: buffers (e.g. rotary frequencies) keep their dtype
            param.data = param.data.to(dtype)
    model.requires_grad_(False).eval()
    for layer in layer_list(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def local_rows(param: DTensor) -> tuple[int, int]:
    """[start, stop) of the full tensor's dim-0 rows that this rank's shard of `param` holds."""
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a parameter sharded on dim 0 over a 1-D mesh, got placements {param.placements}")
    rows, ranks = param.shape[0], param.device_mesh.size()
    per_rank = -(-rows // ranks)  # FSDP2 chunks dim 0 as torch.chunk does
    start = min(param.device_mesh.get_local_rank() * per_rank, rows)
    stop = min(start + per_rank, rows)
    if stop - start != param.to_local().shape[0]:
        raise AssertionError(f"shard of {rows} rows over {ranks} ranks: expected {stop - start} local rows")
    return start, stop


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameter storage on this rank (a DTensor counts its local shard)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        total += local.numel() * local.element_size()
    return total
