"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay.

The warmup follows diffusers' `get_*_schedule_with_warmup`, which Sana's trainer uses: the factor
is step / warmup_steps, so the very first step runs at lr 0 and step `warmup_steps` at the full lr.
"""

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupDecayLR(LambdaLR):
    """LambdaLR whose state is only the position in the schedule.

    The schedule (warmup, decay, base lr) is this run's config, not state: a resume may change
    optimizer.lr. What `state_dict` returns is what a checkpoint (and Accelerate's scheduler.bin)
    holds: LambdaLR's own entries with `lr_lambdas` = [None] (which survives DCP's flattening, where
    LambdaLR's [{}] vanishes), so a plain LambdaLR.load_state_dict accepts it too.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor):
        self.factor = factor
        super().__init__(optimizer, factor)

    def state_dict(self) -> dict:
        state = super().state_dict()  # every attribute but the optimizer and the schedule functions
        del state["factor"]
        state["lr_lambdas"] = [None] * len(state["lr_lambdas"])
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume the saved position; the lr of every group follows from this run's base lr."""
        base_lrs = list(self.base_lrs)  # from this run's optimizer.lr
        super().load_state_dict(state)
        self.base_lrs = base_lrs
        scale = self.factor(self.last_epoch)
        for group, base_lr in zip(self.optimizer.param_groups, base_lrs):
            group["lr"] = base_lr * scale  # as LambdaLR computes it: unchanged when the lr is
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config, total_steps: int) -> WarmupDecayLR:
    """From the [lr_scheduler] section: warm up linearly over `warmup_steps`; then hold ("constant"),
    or decay by "cosine" or "linear" to min_lr_ratio * lr at `total_steps` and stay there."""
    factor = functools.partial(
        lr_factor,
        warmup_steps=config.warmup_steps,
        decay=config.decay_type,
        total_steps=total_steps,
        min_lr_ratio=config.min_lr_ratio,
    )
    return WarmupDecayLR(optimizer, factor)


def lr_factor(step: int, *, warmup_steps: int, decay: str, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the base lr at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return step / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    remaining = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining
