"""A frozen model sharded over the data-parallel ranks: each rank keeps 1/N of its weights.

Sana's trainer wraps its frozen text encoder in FSDP layer by layer so that no rank holds all of it.
Here: `fully_shard` on every layer of the encoder's layer list and on the root, over a 1-D mesh, with
parameters frozen (requires_grad False) in one dtype (bf16 by default). A forward all-gathers one layer
at a time and frees it afterwards; the model belongs to no optimizer and no checkpoint.

The token embedding is split by rows too, but never gathered: a whole-table all-gather would put the
largest tensor of the model on every rank (Gemma-2-2B's 256k x 2304 table is 1.2 GB in bf16, more than a
fifth of the model) for the whole forward. Instead each rank keeps its rows, and a lookup gathers every
rank's token ids, each rank fills in the rows it holds, and a reduce-scatter returns each rank the
embeddings of its own tokens (the vocabulary-parallel embedding of tensor parallelism).

Every rank of the mesh must run the same number of forwards (each one is a sequence of collectives),
even a rank with nothing to encode.
"""

import torch
import torch.distributed as dist
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
    """Freeze `model`, cast its parameters to `dtype` and shard it over the 1-D `mesh` (in place; returned).

    `model` is a Hugging Face model (`get_input_embeddings` / `set_input_embeddings`) on the meta device
    (then `to_empty` it and fill the local shards) or materialised.
    """
    if mesh.ndim != 1:
        raise ValueError(f"the frozen encoder shards over a 1-D mesh, got {mesh.ndim} dimensions")
    with torch.no_grad():
        for param in model.parameters():  # parameters only: buffers (e.g. rotary frequencies) keep their dtype
            param.data = param.data.to(dtype)
    model.requires_grad_(False).eval()
    embedding = VocabShardedEmbedding(model.get_input_embeddings(), mesh)
    model.set_input_embeddings(embedding)
    for layer in layer_list(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=set(embedding.parameters()))
    return model


class VocabShardedEmbedding(nn.Module):
    """A token embedding whose rows are split over the ranks of `mesh`; lookups are collectives.

    `weight` is a DTensor sharded on dim 0 (rows as FSDP would chunk them). The wrapped module keeps its
    forward, which must be a row lookup possibly followed by an elementwise scale (nn.Embedding, Gemma's
    scaled embedding); it runs on this rank's rows.
    """

    def __init__(self, embedding: nn.Module, mesh: DeviceMesh):
        super().__init__()
        full = embedding.weight
        rows, ranks = full.shape[0], mesh.size()
        per_rank = -(-rows // ranks)
        self.start = min(mesh.get_local_rank() * per_rank, rows)
        self.stop = min(self.start + per_rank, rows)
        local = full.detach()[self.start : self.stop].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        self.weight = nn.Parameter(sharded, requires_grad=False)
        self.mesh = mesh
        del embedding.weight  # the wrapped module reads this rank's rows, set before each lookup
        if getattr(embedding, "padding_idx", None) is not None:
            embedding.padding_idx = None  # only steers gradients, and may lie outside this rank's rows
        self.lookup = embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        group, ranks = self.mesh.get_group(), self.mesh.size()
        shape = torch.tensor(ids.shape, device=ids.device)
        shapes = [torch.empty_like(shape) for _ in range(ranks)]
        dist.all_gather(shapes, shape, group=group)
        batch, length = (int(max(s[dim] for s in shapes)) for dim in (0, 1))
        padded = ids.new_zeros(batch, length)
        padded[: ids.shape[0], : ids.shape[1]] = ids
        gathered = [torch.empty_like(padded) for _ in range(ranks)]
        dist.all_gather(gathered, padded, group=group)
        every = torch.stack(gathered)  # [ranks, batch, length]: every rank's ids
        held = (every >= self.start) & (every < self.stop)
        self.lookup.weight = self.weight.to_local().detach()  # a plain tensor: not a second parameter
        rows = self.lookup(torch.where(held, every - self.start, 0)) * held.unsqueeze(-1)
        mine = rows.new_empty(rows.shape[1:])
        # the sum over ranks is the row itself: each id is held by exactly one rank
        dist.reduce_scatter_single(mine, rows.reshape(-1, *rows.shape[2:]).contiguous(), group=group)
        return mine[: ids.shape[0], : ids.shape[1]]


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
