"""Exponential moving average of the weights, kept as DTensors sharded exactly like the parameters.

The reference drops EMA under FSDP; here each rank averages its own shards, so EMA costs 1/N of
the model per rank and is saved and resumed with the rest of the sharded state (it is a Stateful).
"""

from contextlib import contextmanager

import torch
from torch import nn

from sana2.components.model_transforms import trainable_parameters


class EMA:
    """The average of the parameters that train; frozen ones (sana2/components/model_transforms.py) never
    change, so their average is themselves and is not kept."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.params = trainable_parameters(model)
        self.shadow = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Restart the average at the model's current weights (e.g. after loading initial weights)."""
        for name, param in self.params.items():
            self.shadow[name].copy_(param.detach())

    @torch.no_grad()
    def update(self) -> None:
        for name, param in self.params.items():
            self.shadow[name].lerp_(param.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow  # the shards themselves: DCP saves them, and a load fills them in place

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, tensor in state.items():
            if tensor is not self.shadow[name]:  # already there when DCP loaded in place
                self.shadow[name].copy_(tensor)

    @contextmanager
    def weights_swapped_in(self):
        """Temporarily run the model with the EMA weights (e.g. to sample validation images)."""
        backup = {name: p.detach().clone() for name, p in self.params.items()}
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.shadow[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(backup[name])
