"""Write training checkpoints in the trainer's DCP layout, for the converter's tests.

Layout (what the trainer writes): `<dump_folder>/checkpoint/step-<N>/` holding the DCP files,
the CRC32 list of each data file (the trainer's ChecksummingWriter), `config.json` and `COMPLETE`.
The functions named `*_worker` run inside `run_distributed` (tests/dist_utils.py), one call per
gloo process.
"""

import copy
import json
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from sana2.components.lr_scheduler import build_lr_scheduler
from sana2.components.optimizer import build_optimizer
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import apply_fsdp
from sana2.formats.dcp_folder import ChecksummingWriter
from sana2.models import build_model

MODEL_NAME = "SanaMS_debug"
EMA_DECAY = 0.9
LEARNING_RATE = 1e-3
WARMUP_STEPS = 3
FULL_OPTIONS = StateDictOptions(full_state_dict=True)


def step_folder(dump_folder: Path, step: int) -> Path:
    return Path(dump_folder) / "checkpoint" / f"step-{step}"


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / WARMUP_STEPS)


class TrainingRun:
    """A sharded SanaMS_debug model with its AdamW optimizer, LambdaLR schedule and EMA weights."""

    def __init__(self, world_size: int, seed: int, with_ema: bool):
        with torch.device("meta"):
            model = build_model(MODEL_NAME)
        mesh = init_device_mesh("cpu", (world_size,))
        self.model = apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
        self.model.to_empty(device="cpu")
        init_weights(self.model, seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup)
        self.ema = {name: p.detach().clone() for name, p in self.model.named_parameters()} if with_ema else None
        self.step = 0

    def train(self, steps: int, rank: int, world_size: int, seed: int) -> None:
        """AdamW steps on random data: every step draws one global batch, each rank takes its rows."""
        generator = torch.Generator().manual_seed(seed)
        global_batch = 2 * world_size
        for _ in range(steps):
            x = torch.randn(global_batch, 4, 8, 8, generator=generator)
            y = torch.randn(global_batch, 1, 16, 32, generator=generator)
            timestep = torch.randint(0, 1000, (global_batch,), generator=generator)
            target = torch.randn(global_batch, 4, 8, 8, generator=generator)
            rows = slice(2 * rank, 2 * rank + 2)
            loss = torch.nn.functional.mse_loss(self.model(x[rows], timestep[rows], y[rows]), target[rows])
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.scheduler.step()
            if self.ema is not None:
                with torch.no_grad():
                    for name, p in self.model.named_parameters():
                        self.ema[name].lerp_(p.detach(), 1 - EMA_DECAY)
            self.step += 1

    def checkpoint_state(self, rank: int) -> dict:
        """The state dict the trainer hands to dcp.save."""
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.scheduler.state_dict(),
            "dataloader": {"epoch": 1, "position": 8 * self.step, "global_batch_size": 8},
            "train_state": {"step": self.step, "epoch": 1, "skipped_steps": 0},
            "rng": {
                f"rank{rank}": {
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                }
            },
        }
        if self.ema is not None:
            state["ema"] = self.ema
        return state

    def save(self, dump_folder: Path, rank: int, world_size: int) -> Path:
        folder = step_folder(dump_folder, self.step)
        dcp.save(self.checkpoint_state(rank), checkpoint_id=folder, storage_writer=ChecksummingWriter(folder))
        if rank == 0:
            config = {"model": {"name": MODEL_NAME}, "training": {"ema_decay": EMA_DECAY}}
            (folder / "config.json").write_text(json.dumps(config, indent=2))
            marker = {"step": self.step, "world_size": world_size, "checksums": True}
            (folder / "COMPLETE").write_text(json.dumps(marker))
        dist.barrier()
        return folder

    def load(self, folder: Path) -> None:
        """Restore model, optimizer, EMA, scheduler and step from a checkpoint of any world size."""
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.scheduler.state_dict(),
            "train_state": {"step": 0, "epoch": 0, "skipped_steps": 0},
        }
        if self.ema is not None:
            state["ema"] = self.ema
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["lr_scheduler"])
        self.step = state["train_state"]["step"]

    def save_full_reference(self, path: Path, rank: int) -> None:
        """torch.save (rank 0) the full model/optimizer/EMA state the converter must reproduce."""
        reference = {
            "model": get_model_state_dict(self.model, options=FULL_OPTIONS),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL_OPTIONS),
            "scheduler": self.scheduler.state_dict(),
        }
        if self.ema is not None:
            reference["ema"] = {name: t.full_tensor() for name, t in self.ema.items()}
        if rank == 0:
            torch.save(reference, path)


def train_and_save_worker(
    rank: int, world_size: int, dump_folder: str, steps: int, with_ema: bool, reference_path: str
) -> None:
    """Train `steps` steps, save the DCP checkpoint, and save the full reference state next to it."""
    run = TrainingRun(world_size, seed=0, with_ema=with_ema)
    run.train(steps, rank, world_size, seed=1)
    run.save(Path(dump_folder), rank, world_size)
    run.save_full_reference(Path(reference_path), rank)


def reshard_worker(rank: int, world_size: int, source_folder: str, dump_folder: str, with_ema: bool) -> None:
    """Load a checkpoint saved at any world size and save the same state at this world size."""
    run = TrainingRun(world_size, seed=0, with_ema=with_ema)
    run.load(Path(source_folder))
    run.save(Path(dump_folder), rank, world_size)


def load_model_state_worker(rank: int, world_size: int, folder: str, result_path: str) -> None:
    """dcp.load a checkpoint's "model" into a sharded model; rank 0 saves its full state dict."""
    run = TrainingRun(world_size, seed=123, with_ema=False)
    state = {"model": get_model_state_dict(run.model)}
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(run.model, state["model"])
    full = get_model_state_dict(run.model, options=FULL_OPTIONS)
    if rank == 0:
        torch.save(full, result_path)


def rng_states(ranks: int) -> dict[int, dict]:
    """Distinct, valid RNG states per rank, as the trainer checkpoints them (under "rank<r>")."""
    states = {}
    with torch.random.fork_rng(devices=[]):
        python, numpy_state = random.getstate(), np.random.get_state()
        for rank in range(ranks):
            random.seed(100 + rank)
            np.random.seed(100 + rank)
            torch.manual_seed(100 + rank)
            states[rank] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        random.setstate(python)
        np.random.set_state(numpy_state)
    return states


def random_batch(model, seed: int, rows: int = 4) -> tuple[torch.Tensor, ...]:
    """(x, timestep, caption, target) of the shapes `model` takes, from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    spatial = (model.input_size,) * len(model.patch_size)
    return (
        torch.randn(rows, model.in_channels, *spatial, generator=generator),
        torch.randint(0, 1000, (rows,), generator=generator),
        torch.randn(rows, 1, *model.caption_shape, generator=generator),
        torch.randn(rows, model.out_channels, *spatial, generator=generator),
    )


def save_single_process_run(folder: Path, config, steps: int, epoch: int = 0, ranks: int = 1) -> dict:
    """Train `config`'s model with its optimizer and schedule for `steps` steps on random data in one
    process, and save a step folder as the trainer does (DCP with CRC32 lists, config.json/.toml,
    COMPLETE); `ranks` RNG states are saved as if that many ranks had. Returns the full state saved
    (model, optimizer keyed by parameter name, ema, rng, step, epoch) and the live objects."""
    model = build_model(config.model.name, **config.model.overrides)
    init_weights(model, config.training.seed)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_lr_scheduler(optimizer, config.lr_scheduler, config.training.steps)
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}
    for step in range(steps):
        x, timestep, caption, target = random_batch(model, seed=step)
        keep = torch.zeros(x.shape[0], dtype=torch.bool)  # no caption dropout: the global RNG stays out of it
        torch.nn.functional.mse_loss(model(x, timestep, caption, None, keep), target).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        with torch.no_grad():
            for name, p in model.named_parameters():
                ema[name].lerp_(p.detach(), 1 - EMA_DECAY)
    rng = rng_states(ranks)
    state = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "lr_scheduler": scheduler.state_dict(),
        "train_state": {"step": steps, "epoch": epoch, "skipped_steps": 0, "consecutive_nonfinite": 0},
        "rng": {f"rank{rank}": states for rank, states in rng.items()},
        "ema": ema,
    }
    folder = Path(folder)
    with warnings.catch_warnings():  # one process, no group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=ChecksummingWriter(folder), no_dist=True)
    (folder / "config.json").write_text(config.to_json())
    (folder / "config.toml").write_text(config.to_toml())
    (folder / "COMPLETE").write_text(json.dumps({"step": steps, "world_size": ranks, "checksums": True}))
    full = {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(get_optimizer_state_dict(model, optimizer)),
        "ema": {k: v.clone() for k, v in ema.items()},
        "rng": rng,
        "step": steps,
        "epoch": epoch,
    }
    return {"full": full, "model": model, "optimizer": optimizer, "scheduler": scheduler}
