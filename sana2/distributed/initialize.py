"""Initialise a (possibly sharded) model so that every world size gets the same weights.

The model gives each tensor's full initial value by name (`model.initial_value`); here each value
is drawn from a generator seeded by (seed, tensor name) and each rank keeps only its own shard.
Random ops applied to DTensors directly would give results that depend on the world size.
"""

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from sana2.seeding import seeded_generator


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter and buffer of `model` (materialised, plain or FSDP-sharded) with its
    initial value; the result does not depend on creation order or on how tensors are sharded."""
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        full = model.initial_value(name, tuple(tensor.shape), seeded_generator("init", seed, name))
        write_full_value(tensor, full)


def write_full_value(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` into `tensor`; a DTensor keeps only its own shard (no communication)."""
    if isinstance(tensor, DTensor):
        # every rank generated the same full value, so no rank needs to send it (src_data_rank=None)
        shard = distribute_tensor(full.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(shard.to_local())
    else:
        tensor.copy_(full)
