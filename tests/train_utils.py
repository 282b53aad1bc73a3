"""Shared set-up for tests that run the trainer: a tiny model on the digits data, nothing extra."""

import json
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from sana2.config import load_config

# Sana's defaults (no position embedding, caption norm at 0.01), not the digits preset's: these runs are
# compared across world sizes and memory options at 1e-5 (CAME's at 1e-4), and with captions at unit
# scale the optimizers turn the rounding noise in the cross-attention key bias's gradient (zero in
# exact arithmetic: softmax ignores a shift shared by all keys) into lr-sized steps whose signs
# depend on the reduction order.
TINY_MODEL = {"depth": 2, "hidden_size": 64, "num_heads": 2, "use_pe": False, "y_norm_scale_factor": 0.01}
TINY = [
    "--model.name=SanaMS_digits",
    *(f"--model.{key}={json.dumps(value)}" for key, value in TINY_MODEL.items()),
    "--training.mixed_precision_param=float32",
    "--training.mixed_precision_reduce=float32",
    "--training.seed=3",
    "--optimizer.lr=0.001",
    "--lr_scheduler.warmup_steps=0",
    "--validation.enable=false",
    "--checkpoint.enable=false",
    "--metrics.enable_tensorboard=false",
]


def tiny_config(dump_folder: Path, *overrides: str):
    """A config for a ~100k-parameter DiT; the digits cache is shared by all tests of a session."""
    return load_config(None, [*TINY, f"--job.dump_folder={dump_folder}", *overrides])


def run_steps(trainer, steps: int) -> list[float]:
    """Run `steps` optimizer steps; returns the global loss of each."""
    return [trainer.train_step().loss for _ in range(steps)]


def run_steps_with_norms(trainer, steps: int) -> tuple[list[float], list[float]]:
    """Run `steps` optimizer steps; returns the global losses and gradient norms (before clipping)."""
    results = [trainer.train_step() for _ in range(steps)]
    return [r.loss for r in results], [r.grad_norm for r in results]


def full_model_state(model) -> dict[str, torch.Tensor]:
    """The unsharded model state dict (collective: every rank must call it)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
