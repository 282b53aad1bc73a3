"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay.

The warmup follows diffusers' `get_*_schedule_with_warmup`, which Sana's trainer uses: the factor
is step / warmup_steps, so the very first step runs at lr 0 and step `warmup_steps` at the full lr.
"""

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

DECAYS = ("constant", "cosine", "linear")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    decay: str,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Warm up linearly over `warmup_steps`; then hold ("constant"), or decay by "cosine" or
    "linear" to min_lr_ratio * lr at `total_steps` and stay there ("constant" ignores both)."""
    if not _is_int(warmup_steps) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be a non-negative integer, got {warmup_steps!r}")
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {', '.join(DECAYS)}; got {decay!r}")
    if not _is_int(total_steps) or total_steps < 0:
        raise ValueError(f"total_steps must be a non-negative integer, got {total_steps!r}")
    if decay != "constant" and total_steps <= warmup_steps:
        raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}) for {decay} decay")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    # a partial of a module-level function: LambdaLR's state dict then holds only the step count
    # (the schedule itself comes from the configuration on resume), and the scheduler pickles.
    factor = functools.partial(
        lr_factor, warmup_steps=warmup_steps, decay=decay, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return LambdaLR(optimizer, factor)


def lr_factor(step: int, *, warmup_steps: int, decay: str, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the base lr at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return step / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    remaining = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
