"""The trainer: builds the mesh, the model (parallelised), the data, the optimizer, the lr schedule,
the EMA, the checkpointer (holding every piece of state), the metrics and the validator from the
config, then runs a loop that delegates to them.

Launched by run_train.sh (torchrun): `python -m sana2.train <config.toml> [--section.key=value ...]`.
"""

import gc
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from sana2.components.checkpoint import CheckpointError, CheckpointManager
from sana2.components.ema import EMA
from sana2.components.flow import FlowMatching
from sana2.components.initial_load import load_initial_weights
from sana2.components.lr_scheduler import build_lr_scheduler
from sana2.components.metrics import MetricsProcessor, StepResult
from sana2.components.optimizer import build_optimizer
from sana2.components.preemption import StopSignal
from sana2.components.text_encoder import store_null_caption
from sana2.components.train_state import ModelState, NonFiniteError, OptimizerState, RNGState, TrainState
from sana2.components.validator import Validator
from sana2.config import ConfigError, JobConfig, main_config, validate_world
from sana2.data.build import build_training_data
from sana2.data.features import DataFormatError
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import materialize, parallelize_sana
from sana2.distributed.utils import build_dp_mesh, init_distributed
from sana2.log import init_logger, logger
from sana2.models import build_model

# The model's output is a reshaped view; nothing here modifies it in place, which is the hazard warned of.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        training, ckpt = config.training, config.checkpoint
        dump_folder = Path(config.job.dump_folder)
        self.rank, self.world_size, self.device = init_distributed()
        self.mesh = build_dp_mesh(self.device, *validate_world(config, self.world_size))
        self.rng = RNGState(self.rank, training.seed)
        data = build_training_data(config, self.rank, self.world_size, self.device)
        self.dataset, self.loader, self.null_caption = data.dataset, data.loader, data.null_caption
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, training.steps)
        self.ema = EMA(self.model, training.ema_decay) if training.ema_decay > 0 else None
        self.flow = FlowMatching.from_config(training)
        self.train_state = TrainState()
        self.stop = StopSignal()
        # loaded in this order: the lr scheduler sets the lr after the optimizer restored its groups
        self.states = {
            "model": ModelState(self.model),
            "optimizer": OptimizerState(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler,
            "dataloader": self.loader,
            "train_state": self.train_state,
            **({"ema": self.ema} if self.ema is not None else {}),
            "rng": self.rng,
        }
        self.checkpointer = None
        if ckpt.enable:
            files = {"config.json": config.to_json(), "config.toml": config.to_toml()}
            where = (dump_folder / ckpt.folder, ckpt.interval, ckpt.keep_latest_k, ckpt.async_mode, self.rank)
            self.checkpointer = CheckpointManager(*where, states=self.states, files=files)
        self._restore()
        num_params = sum(p.numel() for p in self.model.parameters())
        self.metrics = MetricsProcessor(config, self.rank, self.world_size, self.device, num_params)
        self.validator = None
        if config.validation.enable:
            self.validator = Validator(
                config,
                self.model,
                self.ema,
                self.metrics.logger,
                data.val_dir,
                _most_common_latent_shape(self.dataset),
                data.text_encoder,
            )

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.train_state.step

    def _build_model(self) -> nn.Module:
        config, data = self.config, self.dataset
        with torch.device("meta"):
            model = build_model(config.model.name, **config.model.overrides)
        for bucket, latent_shape in zip(data.buckets, data.latent_shapes):
            try:
                model.check_fits(latent_shape, (data.caption_length, data.caption_dim))
            except ValueError as exc:
                where = config.data.path if config.data.mode == "precomputed" else "(online)"
                bucket_name = f" bucket {bucket['name']}" if len(data.buckets) > 1 else ""
                raise ConfigError(f"{config.source}: [model] does not fit [data] {where}{bucket_name}: {exc}") from None
        parallelize_sana(model, self.mesh, config)
        materialize(model, self.device, config.parallelism.cpu_offload)
        init_weights(model, config.training.seed)  # each rank fills only its own shards
        return model.train()

    def _restore(self) -> None:
        """Resume from a checkpoint; else start from the configured initial weights, if any."""
        ckpt = self.config.checkpoint
        path = self.checkpointer.resume(ckpt.resume_from) if self.checkpointer else None
        if path is not None:
            logger.info(f"resumed from {path} at step {self.step}")  # with the null caption it was saved with
            return
        if ckpt.initial_load_path:
            kept = load_initial_weights(self.model, ckpt.initial_load_path)
            if kept:  # a diffusers folder holds no null caption
                logger.info(f"{', '.join(kept)}: not in {ckpt.initial_load_path}; the run's initial value is kept")
            if self.ema is not None:
                self.ema.copy_from_model()  # the average starts from the loaded weights, not the init
            logger.info(f"model weights loaded from {ckpt.initial_load_path}")
        if self.null_caption is not None:  # the data's encoder's empty prompt; checkpoints carry it from here
            store_null_caption(self.model, self.null_caption)

    def train_step(self) -> StepResult:
        step = self.step + 1
        with self.metrics.waiting_for_data():
            micro_batches = self.loader.next_step()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        sample_losses, sample_sigmas = [], []
        for index, batch in enumerate(micro_batches):
            # gradients are reduce-scattered once per step, after the last micro-batch
            self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            inputs = {key: value.to(self.device) for key, value in batch.items() if key != "indices"}
            draw = self.flow.draw(step, batch["indices"], tuple(inputs["latents"].shape[1:])).to(self.device)
            per_sample = self.flow.loss(self.model, inputs, draw)
            (per_sample.mean() / len(micro_batches)).backward()
            loss_sum += per_sample.detach().sum().double()
            sample_losses.append(per_sample.detach())
            sample_sigmas.append(draw.sigma)
        max_norm = self.config.training.max_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        loss, samples, stop = self._agree(loss_sum, sum(len(b["indices"]) for b in micro_batches))
        grad_norm = grad_norm.item()
        limit = self.config.training.max_consecutive_nonfinite
        applied = self.train_state.count_step(step, loss, grad_norm, limit)
        if applied:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.train_state.step, self.train_state.epoch = step, self.loader.epoch
        tokens = samples * self.model.num_tokens(tuple(micro_batches[0]["latents"].shape[1:]))
        losses, sigmas = torch.cat(sample_losses), torch.cat(sample_sigmas)
        return StepResult(loss, grad_norm, lr, samples, tokens, losses, sigmas, applied, stop)

    def _agree(self, loss_sum: torch.Tensor, local_samples: int) -> tuple[float, int, bool]:
        """One all-reduce for what every rank must agree on: the global mean loss, the global sample
        count, and whether any rank received a stop signal."""
        flags = torch.stack(
            [
                loss_sum,
                torch.tensor(float(local_samples), device=self.device, dtype=torch.float64),
                torch.tensor(float(self.stop.received), device=self.device, dtype=torch.float64),
            ]
        )
        dist.all_reduce(flags)
        return (flags[0] / flags[1]).item(), int(flags[1].item()), bool(flags[2].item())

    def train(self) -> None:
        config, total = self.config, self.config.training.steps
        if self.validator and config.validation.at_start and self.step == 0:
            self.validator.run(self.step)
        self.stop.install()
        while self.step < total:
            self.metrics.begin_step()
            result = self.train_step()
            self.metrics.end_step(self.step, result, self.train_state.skipped_steps)
            if self.validator and self.step % config.validation.freq == 0:
                self.validator.run(self.step)
            if result.stop:
                logger.info(f"stop requested: saving at step {self.step} and exiting")
                self.save_checkpoint(final=True)
                break
            if self.checkpointer and self.checkpointer.should_save(self.step) and self.step < total:
                self.save_checkpoint()
        else:
            self.save_checkpoint(final=True)
        if self.checkpointer:
            self.checkpointer.wait()
        self.metrics.close()

    def save_checkpoint(self, final: bool = False) -> None:
        """Save this step; a final save (end of training, stop signal) blocks and raises if it fails."""
        if self.checkpointer is None:
            return
        seconds = self.checkpointer.save(self.step, final=final)
        self.metrics.logger.scalars(self.step, {"checkpoint/blocking_seconds": seconds})
        logger.info(f"checkpoint step {self.step}: training blocked {seconds:.2f}s")


def _most_common_latent_shape(dataset) -> tuple[int, ...]:
    """The latent shape validation samples at: that of the bucket with the most samples (the first of equals)."""
    counts = [bucket["num_samples"] for bucket in dataset.buckets]
    return dataset.latent_shapes[counts.index(max(counts))]


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        config = main_config(argv)
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info(f"config ({config.source}) resolved:\n{config.to_toml()}")
        trainer = Trainer(config)
        if trainer.rank == 0:
            dump_folder = Path(config.job.dump_folder)
            dump_folder.mkdir(parents=True, exist_ok=True)
            (dump_folder / "config.toml").write_text(config.to_toml())
        trainer.train()
    except (ConfigError, CheckpointError, DataFormatError, NonFiniteError) as exc:
        logger.error(str(exc))
        return 2
    finally:
        # free the model (its FSDP state holds the process groups) while Python is fully alive: left to
        # interpreter exit, tearing down the gloo groups' threads aborts the process (SIGABRT, ~1 run in 2)
        trainer = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
