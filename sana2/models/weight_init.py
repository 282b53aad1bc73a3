"""The reference initialisation scheme (docs/model.md, "Initialisation"), one full value per tensor.

`initial_value` returns the full tensor a parameter or buffer starts from, drawn from the generator
it is given. Whoever owns the storage writes it: sana2/distributed/initialize.py seeds one generator
per tensor name and copies each rank's shard, which makes initialisation the same at every world
size (random ops applied to sharded tensors directly are not).
"""

import math

import torch
from torch import nn

from sana2.models.layers import RMSNorm

# Linear layers whose weights are re-drawn N(0, 0.02) after the global xavier pass.
NORMAL_002_LINEARS = (
    "t_embedder.mlp.0",
    "t_embedder.mlp.2",
    "t_block.1",
    "y_embedder.y_proj.fc1",
    "y_embedder.y_proj.fc2",
)


def _uniform(shape, bound, generator):
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def initial_value(model: nn.Module, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """The full initial value of `model`'s parameter or buffer `name`."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if name == "pos_embed":
        return model.initial_pos_embed()
    if name == "y_embedder.y_embedding":
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    if leaf == "scale_shift_table":
        return torch.randn(shape, generator=generator) / math.sqrt(shape[-1])
    if isinstance(module, RMSNorm):
        return torch.full(shape, float(module.init_scale))
    if isinstance(module, nn.LayerNorm):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if isinstance(module, nn.Linear):
        if leaf == "bias":
            return torch.zeros(shape)
        if module_name in NORMAL_002_LINEARS:
            return torch.empty(shape).normal_(0.0, 0.02, generator=generator)
        return nn.init.xavier_uniform_(torch.empty(shape), generator=generator)
    if isinstance(module, (nn.Conv2d, nn.Conv3d)):
        fan_in = math.prod(module.weight.shape[1:])
        if module_name == "x_embedder.proj" and leaf == "weight":
            # xavier on the [D, C * prod(patch)] view, as for a Linear patch projection
            flat = nn.init.xavier_uniform_(torch.empty(shape[0], fan_in), generator=generator)
            return flat.view(shape)
        if module_name.endswith("t_conv"):
            return torch.zeros(shape)  # the temporal branch starts switched off
        return _uniform(shape, 1.0 / math.sqrt(fan_in), generator)  # PyTorch's conv default
    raise ValueError(f"no initialisation rule for tensor {name!r} ({type(module).__name__})")
