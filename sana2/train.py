"""The trainer: composes model, parallelism, data, optimizer, checkpointing and metrics.

Launched by run_train.sh (torchrun): `python -m sana2.train <config.toml> [--section.key=value ...]`.
"""

import gc
import math
import os
import random
import signal
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from sana2.components import flow
from sana2.components.checkpoint import CheckpointError, CheckpointManager
from sana2.components.data import DataFormatError, DistributedFeatureLoader, FeatureDataset, build_digits_dataset
from sana2.components.ema import EMA
from sana2.components.initial_load import load_initial_weights
from sana2.components.lr_scheduler import build_lr_scheduler
from sana2.components.metrics import (
    MetricLogger,
    TimestepBuckets,
    all_reduce_stats,
    flops_per_sample,
    format_log_line,
    memory_stats,
    peak_flops,
)
from sana2.components.optimizer import build_optimizer
from sana2.config import ConfigError, JobConfig, main_config, validate_world
from sana2.distributed.parallelize import parallelize_sana
from sana2.distributed.utils import RunOnRank0Error, build_dp_mesh, init_distributed, run_on_rank0
from sana2.log import init_logger, logger
from sana2.models import build_model
from sana2.validator import Validator

# The model's output is a reshaped view; nothing here modifies it in place, which is the hazard warned of.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def sample_seed(seed: int, step: int, index: int) -> int:
    """A generator seed for one sample at one step: randomness that no world size or resume can change."""
    return ((seed * 1_000_003 + step) * 998_244_353 + index) % (2**63)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Trainer:
    def __init__(self, config: JobConfig):
        self.config = config
        self.rank, self.world_size, self.device = init_distributed()
        replicate, shard = validate_world(config, self.world_size)
        self.mesh = build_dp_mesh(self.device, replicate, shard)
        self.dump_folder = Path(config.job.dump_folder)
        training = config.training
        torch.manual_seed(training.seed)
        random.seed(training.seed)
        np.random.seed(training.seed)

        train_dir, val_dir = self._data_dirs()
        self.dataset = FeatureDataset(train_dir)
        try:
            self.loader = DistributedFeatureLoader(
                self.dataset,
                training.local_batch_size,
                training.gradient_accumulation_steps,
                self.rank,
                self.world_size,
                training.seed,
            )
        except ValueError as exc:  # e.g. fewer samples than one global batch
            raise ConfigError(f"{config.source}: [training] does not fit data.path {train_dir}: {exc}") from None
        self.model = self._build_model()
        opt = config.optimizer
        self.optimizer = build_optimizer(
            self.model,
            opt.name,
            lr=opt.lr,
            weight_decay=opt.weight_decay,
            betas=tuple(opt.betas),
            eps=opt.eps[0] if len(opt.eps) == 1 else tuple(opt.eps),
        )
        sched = config.lr_scheduler
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, sched.warmup_steps, sched.decay_type, training.steps, sched.min_lr_ratio
        )
        self.ema = EMA(self.model, training.ema_decay) if training.ema_decay > 0 else None
        self.step = 0
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.stop_requested = False  # agreed by all ranks: acted on after the current step
        self._signal_received = False  # this rank's own: set by SIGTERM/SIGINT, never cleared

        ckpt = config.checkpoint
        self.checkpointer = (
            CheckpointManager(
                self.dump_folder / ckpt.folder, ckpt.interval, ckpt.keep_latest_k, ckpt.async_mode, self.rank
            )
            if ckpt.enable
            else None
        )
        resumed = self._resume()
        if not resumed and ckpt.initial_load_path:
            load_initial_weights(self.model, ckpt.initial_load_path)
            if self.ema is not None:
                self.ema.copy_from_model()  # the average starts from the loaded weights, not the init
            logger.info(f"model weights loaded from {ckpt.initial_load_path}")

        run_name = datetime.now().strftime("%Y%m%d-%H%M%S")
        tb_dir = self.dump_folder / "tb" / run_name if config.metrics.enable_tensorboard else None
        self.metrics = MetricLogger(tb_dir if self.rank == 0 else None, self.rank)
        self.metrics.text("config", f"```\n{config.to_json()}\n```")
        self.validator = (
            Validator(
                config,
                self.model,
                self.ema,
                self.metrics,
                val_dir,
                self.rank,
                self.world_size,
                self.device,
                self.dataset.latent_shape,
            )
            if config.validation.enable
            else None
        )
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.tokens_per_sample = math.prod(s // p for s, p in zip(self.dataset.latent_shape[1:], self.model.patch_size))
        self.peak_flops = peak_flops(self.device, config.metrics.peak_flops or None)

    # -- set-up ---------------------------------------------------------------------------------
    def _data_dirs(self) -> tuple[Path, Path | None]:
        data = self.config.data
        if data.path != "digits":
            return Path(data.path), Path(data.val_path) if data.val_path else None
        root = self.dump_folder.parent / "data" / "digits"
        try:  # one builder; the others wait and read the result
            return run_on_rank0(
                lambda: build_digits_dataset(root, data.text_encoder, data.caption_length),
                lambda exc: (
                    f"{self.config.source}: cannot build the digits data with "
                    f"data.text_encoder = {data.text_encoder!r}: {exc}"
                ),
            )
        except RunOnRank0Error as exc:
            raise ConfigError(str(exc)) from None

    def _build_model(self):
        config = self.config
        with torch.device("meta"):
            model = build_model(config.model.name, **config.model.overrides)
        self._check_model_fits_data(model)
        parallelize_sana(model, self.mesh, config)
        offload = config.parallelism.cpu_offload
        model.to_empty(device="cpu" if offload else self.device)  # offloaded shards live on the CPU
        model.init_weights(seed=config.training.seed)  # each rank fills only its own shards
        if offload:  # FSDP moves parameters to the device for compute, not buffers
            for module in model.modules():
                for name, buffer in module.named_buffers(recurse=False):
                    module.register_buffer(name, buffer.to(self.device))
        model.train()
        return model

    def _check_model_fits_data(self, model) -> None:
        meta = self.dataset
        problems = []
        if model.in_channels != meta.latent_shape[0]:
            problems.append(
                f"model in_channels={model.in_channels} but the data's latents have {meta.latent_shape[0]} channels"
            )
        if model.y_embedder.y_proj.fc1.in_features != meta.caption_dim:
            problems.append(
                f"model caption_channels={model.y_embedder.y_proj.fc1.in_features} but the data's "
                f"caption embeddings have {meta.caption_dim}"
            )
        spatial = meta.latent_shape[1:]
        if len(spatial) != len(model.patch_size):
            problems.append(
                f"the model takes {len(model.patch_size)}-D latents, the data's are {len(spatial)}-D "
                f"{meta.latent_shape}"
            )
        elif any(size % p for size, p in zip(spatial, model.patch_size)):
            problems.append(
                f"the data's latent size {tuple(spatial)} is not divisible by the patch size {model.patch_size}"
            )
        if model.y_embedder.y_embedding.shape[0] != meta.caption_length:
            problems.append(
                f"model model_max_length={model.y_embedder.y_embedding.shape[0]} but the data's "
                f"captions have {meta.caption_length} tokens"
            )
        if problems:
            raise ConfigError(
                f"{self.config.source}: [model] does not fit [data] {self.config.data.path}: " + "; ".join(problems)
            )

    # -- checkpoint state -----------------------------------------------------------------------
    def state_for_checkpoint(self) -> dict:
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "dataloader": self.loader.state_dict(),
            "train_state": {
                "step": self.step,
                "epoch": self.loader.epoch,
                "skipped_steps": self.skipped_steps,
                "consecutive_nonfinite": self.consecutive_nonfinite,
            },
            "rng": {f"rank{self.rank}": rng_state()},
        }
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def save_checkpoint(self, final: bool = False) -> float | None:
        """Save this step; a final save (end of training, stop signal) blocks and raises if it fails."""
        if self.checkpointer is None:
            return None
        files = {"config.json": self.config.to_json(), "config.toml": self.config.to_toml()}
        return self.checkpointer.save(self.step, self.state_for_checkpoint(), files, final=final)

    def _resume(self) -> bool:
        if self.checkpointer is None:
            return False
        path = self.checkpointer.resume_path(self.config.checkpoint.resume_from)
        if path is None:
            return False
        state = self.state_for_checkpoint()
        if not any(key.startswith(f"rng.rank{self.rank}.") for key in self.checkpointer.stored_keys(path)):
            del state["rng"]  # saved by fewer ranks than this run has: this rank starts a fresh RNG
        self.checkpointer.load(path, state)
        set_model_state_dict(self.model, state["model"])  # a no-op copy when DCP filled the parameters in place
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        # the schedule's base lr comes from this run's config: a resume may change optimizer.lr
        self.lr_scheduler.base_lrs = [self.config.optimizer.lr for _ in self.lr_scheduler.base_lrs]
        factor = self.lr_scheduler.lr_lambdas[0](self.lr_scheduler.last_epoch)
        for group, base_lr in zip(self.optimizer.param_groups, self.lr_scheduler.base_lrs):
            group["lr"] = base_lr * factor  # as LambdaLR computes it: unchanged when the lr is
        try:
            self.loader.load_state_dict(state["dataloader"])
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
        self.step = state["train_state"]["step"]
        self.skipped_steps = state["train_state"]["skipped_steps"]
        self.consecutive_nonfinite = state["train_state"]["consecutive_nonfinite"]
        if "rng" in state:
            set_rng_state(state["rng"][f"rank{self.rank}"])
        logger.info(f"resumed from {path} at step {self.step}")
        return True

    # -- training -------------------------------------------------------------------------------
    def sample_randomness(self, step: int, indices: torch.Tensor, shape: tuple[int, ...]):
        """Per-sample sigma, noise and caption-drop decision, a function of (seed, step, sample)."""
        t = self.config.training
        sigmas, noises, drops = [], [], []
        for index in indices.tolist():
            generator = torch.Generator().manual_seed(sample_seed(t.seed, step, index))
            sigmas.append(flow.sample_sigmas(1, t.flow_shift, t.logit_mean, t.logit_std, generator))
            drops.append(torch.rand(1, generator=generator) < t.caption_dropout)
            noises.append(torch.randn(shape, generator=generator))
        to = self.device
        return torch.cat(sigmas).to(to), torch.stack(noises).to(to), torch.cat(drops).to(to)

    def train_step(self, buckets: TimestepBuckets) -> dict[str, float]:
        step = self.step + 1
        start = time.perf_counter()
        micro_batches = self.loader.next_step()
        data_seconds = time.perf_counter() - start
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        sample_losses, sample_sigmas = [], []
        for index, batch in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            x0 = batch["latents"].to(self.device)
            sigma, noise, drop = self.sample_randomness(step, batch["indices"], tuple(x0.shape[1:]))
            x_t, target = flow.noised(x0, noise, sigma)
            prediction = self.model(
                x_t,
                flow.model_timestep(sigma),
                batch["caption_embeds"].to(self.device),
                batch["caption_mask"].to(self.device),
                drop_ids=drop,
            )
            per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
            (per_sample.mean() / len(micro_batches)).backward()
            loss_sum += per_sample.detach().sum().double()
            sample_losses.append(per_sample.detach())
            sample_sigmas.append(sigma)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.config.training.max_norm or float("inf"), foreach=True
        )
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        # one collective for the global loss and the flags every rank must agree on
        local_count = sum(len(b["indices"]) for b in micro_batches)
        flags = torch.stack(
            [
                loss_sum,
                torch.tensor(float(local_count), device=self.device, dtype=torch.float64),
                torch.tensor(float(self._signal_received), device=self.device, dtype=torch.float64),
            ]
        )
        dist.all_reduce(flags)
        loss = (flags[0] / flags[1]).item()
        self.stop_requested = bool(flags[2].item())
        grad_norm = grad_norm.item()
        if math.isfinite(loss) and math.isfinite(grad_norm):
            buckets.add(torch.cat(sample_losses), torch.cat(sample_sigmas))  # skipped steps would be NaN
            self.optimizer.step()
            if self.ema is not None:
                self.ema.update()
            self.consecutive_nonfinite = 0
        else:
            self.skipped_steps += 1
            self.consecutive_nonfinite += 1
            logger.warning(
                f"step {step}: non-finite loss {loss} or grad norm {grad_norm}; update skipped "
                f"({self.consecutive_nonfinite} in a row)"
            )
            limit = self.config.training.max_consecutive_nonfinite
            if self.consecutive_nonfinite >= limit:
                raise NonFiniteError(
                    f"{self.consecutive_nonfinite} consecutive steps had a non-finite loss or "
                    f"gradient norm (training.max_consecutive_nonfinite = {limit}); stopping"
                )
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        self.lr_scheduler.step()
        self.step = step
        return {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "data_seconds": data_seconds,
            "samples": flags[1].item(),
        }

    def train(self) -> None:
        config = self.config
        total = config.training.steps
        if self.validator and config.validation.at_start and self.step == 0:
            self.validator.run(self.step)
        self._install_signal_handlers()
        buckets = TimestepBuckets()
        window_seconds, window_steps, window_data = 0.0, 0, 0.0  # training steps only, not saves
        run_seconds, start_step = 0.0, self.step
        while self.step < total:
            step_start = time.perf_counter()
            result = self.train_step(buckets)
            elapsed = time.perf_counter() - step_start
            window_seconds, window_steps, window_data = (
                window_seconds + elapsed,
                window_steps + 1,
                window_data + result["data_seconds"],
            )
            run_seconds += elapsed
            if self.step % config.metrics.log_freq == 0 or self.step == total:
                eta = run_seconds / (self.step - start_step) * (total - self.step)
                self._log(result, buckets, window_seconds / window_steps, window_data / window_seconds, eta)
                buckets = TimestepBuckets()
                window_seconds, window_steps, window_data = 0.0, 0, 0.0
            if self.validator and self.step % config.validation.freq == 0:
                self.validator.run(self.step)
            if self.stop_requested:
                logger.info(f"stop requested: saving at step {self.step} and exiting")
                self.save_checkpoint(final=True)
                break
            if self.checkpointer and self.checkpointer.should_save(self.step) and self.step < total:
                self._save_and_log()
        else:
            self._save_and_log(final=True)
        if self.checkpointer:
            self.checkpointer.wait()
        self.metrics.close()

    def _save_and_log(self, final: bool = False) -> None:
        seconds = self.save_checkpoint(final)
        if seconds is not None:
            self.metrics.scalars(self.step, {"checkpoint/blocking_seconds": seconds})
            logger.info(f"checkpoint step {self.step}: training blocked {seconds:.2f}s")

    def _log(self, result, buckets, step_seconds, data_share, eta_seconds) -> None:
        global_batch = result["samples"]
        memory = memory_stats(self.device)
        memory_max = all_reduce_stats(memory, "max")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # each log reports its own window's peak
        values = {
            "loss": result["loss"],
            "grad_norm": result["grad_norm"],
            "lr": result["lr"],
            "skipped_steps": float(self.skipped_steps),
            "step_seconds": step_seconds,
            "data_wait_share": data_share,
            "samples_per_second": global_batch / step_seconds,
            "tokens_per_second": global_batch * self.tokens_per_sample / step_seconds,
            **buckets.reduce(),
            **{k.replace("memory/", "memory/max_over_ranks/"): v for k, v in memory_max.items()},
            **{k.replace("memory/", "memory/rank0/"): v for k, v in memory.items()},
        }
        if self.peak_flops:
            achieved = flops_per_sample(self.num_params, self.tokens_per_sample) * global_batch / step_seconds
            values["mfu"] = achieved / (self.peak_flops * self.world_size)
        self.metrics.scalars(self.step, values)
        if self.rank == 0:
            line = format_log_line(self.step, self.config.training.steps, {**values, **memory_max}, eta_seconds)
            logger.info(line)
            if data_share > self.config.metrics.slow_data_warning:
                logger.warning(f"data loading took {data_share:.0%} of the step time")

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            # only recorded here: the next step's all-reduce turns it into the agreed stop_requested
            self._signal_received = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        config = main_config(argv)
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info(f"config ({config.source}) resolved:\n{config.to_toml()}")
        trainer = Trainer(config)
        if trainer.rank == 0:
            trainer.dump_folder.mkdir(parents=True, exist_ok=True)
            (trainer.dump_folder / "config.toml").write_text(config.to_toml())
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
