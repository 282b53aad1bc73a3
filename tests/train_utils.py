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


# -- the record of a short run, compared across world sizes and parallelisms ------------------------
STEPS = 4  # optimizer steps of train_and_record


def train_and_record(rank, world_size, dump, out_file, *overrides):
    """A run_distributed function: STEPS steps of the tiny config (global batch 16, clipping at 0.5), then
    validation if enabled; rank 0 saves the losses, gradient norms, full state and reduce-scatters per step."""
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, "--training.global_batch_size=16", "--training.max_norm=0.5", *overrides))
    reduce_scatters = []
    real_reduce_scatter = torch.distributed.reduce_scatter_single

    def counting_reduce_scatter(*args, **kwargs):
        reduce_scatters.append(1)
        return real_reduce_scatter(*args, **kwargs)

    torch.distributed.reduce_scatter_single = counting_reduce_scatter  # FSDP2 calls it through the module
    losses, norms = run_steps_with_norms(trainer, STEPS)
    torch.distributed.reduce_scatter_single = real_reduce_scatter
    if trainer.validator is not None:
        trainer.validator.run(trainer.step)  # sampling works for this model too
    state = full_model_state(trainer.model)
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "grad_norms": norms,
                "state": state,
                "reduce_scatters_per_step": len(reduce_scatters) / STEPS,
            },
            out_file,
        )


def assert_same_run(result, reference, loss_atol, param_atol):
    """Two train_and_record records agree: losses, clipped gradient norms and every parameter."""
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(reference["losses"]), atol=loss_atol, rtol=0
    )
    # the clipped norm is the true global norm over all shards (clipping is active: max_norm 0.5)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), atol=loss_atol, rtol=1e-5
    )
    assert min(reference["grad_norms"]) > 0.5
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(result["state"][key], value, atol=param_atol, rtol=0, msg=key)


# -- a tiny video model on random Wan-shaped latents ------------------------------------------------
TINY_VIDEO_MODEL = [
    "--model.name=SanaMSVideo",
    "--model.hidden_size=64",
    "--model.depth=2",
    "--model.num_heads=2",
    "--model.linear_head_dim=32",
    "--model.caption_channels=64",
    "--model.model_max_length=5",
    "--model.input_size=8",
]
VIDEO_VALIDATION = [  # one prompt, one clip, two sampling steps: validation runs through the model
    "--validation.enable=true",
    "--validation.prompts=['a clip']",
    "--validation.images_per_prompt=1",
    "--validation.sampling_steps=2",
    "--validation.num_loss_samples=0",
]


def write_video_features(path: Path, frames: int = 3, seed: int = 0) -> Path:
    """16 samples of [16, frames, 8, 8] latents (frames 1: images through the Wan VAE) with 5-token captions of
    64 channels, every other one padded after 3 tokens."""
    from sana2.data.writer import write_feature_dataset

    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(16, 5, dtype=torch.int64)
    mask[::2, 3:] = 0
    latents = torch.randn(16, 16, frames, 8, 8, generator=generator)
    write_feature_dataset(path, latents, torch.randn(16, 5, 64, generator=generator), mask)
    return path
