"""Sana's side of a resume, rebuilt for tests from what Sana's and Accelerate's source do.

Sana's trainer cannot run here (it needs CUDA, mmcv, its repository), so these helpers do what it
does, written from its behaviour: its optimizer construction (one param group per parameter),
its CAME optimizer (`CAMEWrapper`), the order its model registers parameters in, how it parses
a checkpoint folder name on resume, and stand-ins for the two Accelerate objects that Accelerate's
FSDP loaders read (its FSDP plugin refuses to be built without an accelerator).
"""

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from torch import nn
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

# -- model and optimizer construction ----------------------------------------------------------------


def register_like_sana(model: nn.Module) -> nn.Module:
    """Reorder each self-attention's submodules as Sana's do: its attention classes extend timm's
    Attention, which registers q_norm and k_norm right after qkv (sana2 registers them after proj)."""
    for block in model.blocks:
        attention = block.attn
        if "q_norm" not in attention._modules:
            continue
        order = ["qkv", "q_norm", "k_norm"] + [n for n in attention._modules if n not in ("qkv", "q_norm", "k_norm")]
        modules = dict(attention._modules)
        attention._modules.clear()
        attention._modules.update((n, modules[n]) for n in order)
    return model


def build_sana_optimizer(model: nn.Module, kind: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """As Sana's build_optimizer: its mmcv constructor gives every parameter its own group, in the
    model's registration order, with the optimizer's defaults (no paramwise overrides configured)."""
    groups = [{"params": [p]} for p in model.parameters()]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    return SanaCAME(groups, lr=lr, weight_decay=weight_decay)


class SanaCAME(torch.optim.Optimizer):
    """Sana's CAMEWrapper, written from its behaviour.

    It decides by the shape it is handed: a 2-D weight or a 1x1 convolution keeps row and column
    means of the squared gradient and of the instability (u - m)^2; anything else (1-D, a 3x3 or
    (3, 1) convolution, a 5-D kernel, and under FSDP every flat 1-D shard) keeps a full-shape
    exp_avg_sq and steps by the momentum alone. The step count is a Python int; "RMS" (the
    parameter's RMS) is recomputed every step and never read.
    """

    def __init__(
        self, params, lr, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999), weight_decay=0.0
    ):
        super().__init__(
            params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas, weight_decay=weight_decay)
        )

    @staticmethod
    def factored(shape) -> bool:
        return len(shape) == 2 or (len(shape) == 4 and tuple(shape[2:]) == (1, 1))

    @staticmethod
    def _rms(tensor):
        return tensor.norm(2) / math.sqrt(tensor.numel())

    @staticmethod
    def _inverse_root(row, col):
        return (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1) * col.unsqueeze(-2).rsqrt()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2, beta3 = group["betas"]
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.float()
                shape = grad.shape
                factored = self.factored(shape)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(grad)
                    if factored:
                        for kind in ("sq", "res"):
                            state[f"exp_avg_{kind}_row"] = torch.zeros(shape[0], dtype=grad.dtype)
                            state[f"exp_avg_{kind}_col"] = torch.zeros(shape[1], dtype=grad.dtype)
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(grad)
                state["step"] += 1
                state["RMS"] = self._rms(p)
                squared = grad.square() + eps1
                if factored:
                    matrix = squared.reshape(shape[0], shape[1])
                    state["exp_avg_sq_row"].mul_(beta2).add_(matrix.mean(dim=1), alpha=1 - beta2)
                    state["exp_avg_sq_col"].mul_(beta2).add_(matrix.mean(dim=0), alpha=1 - beta2)
                    inverse = self._inverse_root(state["exp_avg_sq_row"], state["exp_avg_sq_col"])
                    update = inverse.view(shape) * grad
                else:
                    state["exp_avg_sq"].mul_(beta2).add_(squared, alpha=1 - beta2)
                    update = state["exp_avg_sq"].rsqrt() * grad
                update = update / (self._rms(update) / group["clip_threshold"]).clamp(min=1.0)
                exp_avg = state["exp_avg"]
                exp_avg.mul_(beta1).add_(update, alpha=1 - beta1)
                if factored:
                    instability = ((update - exp_avg).square() + eps2).reshape(shape[0], shape[1])
                    state["exp_avg_res_row"].mul_(beta3).add_(instability.mean(dim=1), alpha=1 - beta3)
                    state["exp_avg_res_col"].mul_(beta3).add_(instability.mean(dim=0), alpha=1 - beta3)
                    inverse = self._inverse_root(state["exp_avg_res_row"], state["exp_avg_res_col"])
                    update = inverse.view(shape) * exp_avg
                else:
                    update = exp_avg.clone()
                if group["weight_decay"] != 0:
                    p.add_(p, alpha=-group["weight_decay"] * group["lr"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])


# -- resume: folder names and the latest pointer ------------------------------------------------------


def resume_position(checkpoint: str | os.PathLike) -> tuple[int, int]:
    """(start_epoch, start_step) as Sana's train.py reads them from the folder name: E - 1 and S."""
    parts = Path(checkpoint).name.replace(".pth", "").split("_")
    return int(parts[1]) - 1, int(parts[3])


def latest_checkpoint(checkpoints: Path) -> Path:
    """What Sana's resume_from=latest picks: latest.pth's real path, else the epoch_* entry of highest step."""
    link = checkpoints / "latest.pth"
    if link.exists():
        return Path(os.path.realpath(link))
    names = [n for n in os.listdir(checkpoints) if n.startswith("epoch_")]
    return checkpoints / max(names, key=lambda n: int(n.replace(".pth", "").split("_")[3]))


# -- Accelerate stand-ins ---------------------------------------------------------------------------


@dataclass
class FsdpPluginStandIn:
    """The attributes of Accelerate's FullyShardedDataParallelPlugin that its FSDP loaders read, set as
    Sana configures it (FULL_STATE_DICT; Accelerate's default full optimizer-state config)."""

    fsdp_version: int = 1
    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT
    state_dict_config: FullStateDictConfig = field(
        default_factory=lambda: FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    )
    optim_state_dict_config: FullOptimStateDictConfig = field(
        default_factory=lambda: FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    )
    sync_module_states: bool = True


class AcceleratorStandIn:
    """The attributes of Accelerator that Accelerate's FSDP loaders read.

    Accelerate's own process state is set up too (its loaders log through it), over the process
    group that is already running.
    """

    is_fsdp2 = False

    def __init__(self):
        PartialState(cpu=True)
        self.process_index = dist.get_rank()
        self.num_processes = dist.get_world_size()
        self.is_main_process = self.process_index == 0

    def wait_for_everyone(self) -> None:
        dist.barrier()
