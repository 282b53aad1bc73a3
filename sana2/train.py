"""The trainer: builds the mesh, the model (parallelised), the data, the optimizer, the lr schedule,
the EMA, the checkpointer (holding every piece of state), the metrics and the validator from the
config, then runs a loop that delegates to them.

Launched by run_train.sh through the sana2 launcher (sana2/launch.py, torchrun's elastic agent):
`python -m sana2.train <config.toml> [--section.key=value ...]` on every worker. Exit codes: 0 done
(also when stopped by a signal, with its checkpoint saved); 2 an error the user must fix, in one
message (config, data, a missing or damaged checkpoint, a full disk, a dump folder in use); 1 an
internal error, with its traceback.
"""

import gc
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

from sana2.cli import CONFIG_JSON, CONFIG_TOML, USER_ERROR
from sana2.components.checkpoint import CheckpointError, CheckpointManager, complete_checkpoints
from sana2.components.ema import EMA
from sana2.components.flow import FlowMatching
from sana2.components.initial_load import load_initial_weights
from sana2.components.lr_scheduler import build_lr_scheduler
from sana2.components.metrics import MetricsProcessor, StepResult, TrackerError
from sana2.components.model_transforms import apply_transforms, build_transforms, frozen_parameter_names
from sana2.components.optimizer import build_optimizer
from sana2.components.ownership import DumpFolderInUse, DumpFolderLock
from sana2.components.preemption import GO_ON, StopAgreement, StopSignal
from sana2.components.train_state import (
    ModelState,
    NonFiniteError,
    OptimizerState,
    RNGState,
    TrainState,
    capture_rng,
    restore_rng,
)
from sana2.components.validator import ValidationError, Validator
from sana2.config import ConfigError, JobConfig, main_config
from sana2.config_help import print_help, wants_help
from sana2.data.build import TrainingDataError, build_training_data
from sana2.data.features import DataFormatError, most_common_latent_shape
from sana2.distributed.context_parallel import ContextParallel
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import ParallelizeError, materialize, parallelize_sana
from sana2.distributed.utils import (
    RunOnRank0Error,
    init_distributed,
    run_on_rank0,
    tell_the_job,
    told_by_another_rank,
)
from sana2.encoders.text_encoder import store_null_caption
from sana2.formats.pipeline import pipeline_defaults
from sana2.log import init_logger, logger
from sana2.models import build_model
from sana2.preflight import check_run
from sana2.staging import NoSpaceError

# The model's output is a reshaped view; nothing here modifies it in place, which is the hazard warned of.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


class Trainer:
    def __init__(self, config: JobConfig, stop: StopSignal | None = None):
        """`stop`: the stop signals to obey (main installs them before anything else); by default
        train() installs its own."""
        self.config = config
        training, ckpt = config.training, config.checkpoint
        dump_folder = Path(config.job.dump_folder)
        self.rank, self.world_size, self.device = init_distributed()
        self.dims, self.batch = check_run(config, self.world_size, self.device.type)
        self.mesh = self.dims.fsdp_mesh  # the one mesh is built here, by every rank
        # context parallelism: the ranks of a cp group read the same clips and split their frames
        self.cp = ContextParallel(self.dims.cp_mesh.get_group()) if self.dims.cp > 1 else None
        self.rng = RNGState(self.rank, training.seed)
        try:
            data = build_training_data(
                config.data,
                config.encoding,
                training,
                dump_folder,
                self.dims,
                self.batch,
                self.device,
                caption_length=config.caption_length,
            )
        except TrainingDataError as exc:
            raise config.error(str(exc)) from None
        self.dataset, self.loader, self.null_caption = data.dataset, data.loader, data.null_caption
        self.datasets = data.datasets  # with joint training, the images too
        self.model = self._build_model()
        self.optimizer = build_optimizer(self.model, config.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config.lr_scheduler, training.steps)
        self.ema = EMA(self.model, training.ema_decay) if training.ema_decay > 0 else None
        self.flow = FlowMatching.from_config(training)
        self.train_state = TrainState()
        self.stop = stop or StopSignal()
        self.stop_agreement = StopAgreement(self.stop, config.job.stop_grace_period, self.rank)
        self._step_seconds: float | None = None  # the last completed step's duration
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
            files = {CONFIG_JSON: config.to_json(), CONFIG_TOML: config.to_toml()}
            where = (dump_folder / ckpt.folder, ckpt.interval, ckpt.keep_latest_k, ckpt.async_mode, self.rank)
            self.checkpointer = CheckpointManager(*where, states=self.states, files=files)
        self._restore()
        num_params = sum(p.numel() for p in self.model.parameters())
        try:
            self.metrics = MetricsProcessor(
                config.metrics,
                self.dims,
                self.device,
                num_params,
                total_steps=training.steps,
                dump_folder=dump_folder,
                config_text=config.to_json(),
            )
        except TrackerError as exc:
            raise config.error(str(exc)) from None
        self.validator = None
        if config.validation.enable:
            try:
                self.validator = Validator(
                    config.validation,
                    config.encoding,
                    self.model,
                    self.ema,
                    self.metrics.logger,
                    flow_shift=training.flow_shift,
                    samples_folder=dump_folder / "samples",
                    val_dir=data.val_dir,
                    latent_shape=most_common_latent_shape(self.dataset.buckets),
                    text_encoder=data.text_encoder,
                    dims=self.dims,
                    cp=self.cp,
                    local_batch_size=self.batch.local,
                )
            except ValidationError as exc:
                raise config.error(str(exc)) from None

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.train_state.step

    def _build_model(self) -> nn.Module:
        config = self.config
        with torch.device("meta"):
            model = build_model(config.model.name, **config.model.overrides)
        fits = [(d, bucket, shape) for d in self.datasets for bucket, shape in zip(d.buckets, d.latent_shapes)]
        for data, bucket, latent_shape in fits:
            try:
                model.check_fits(latent_shape, (data.caption_length, data.caption_dim))
            except ValueError as exc:
                where = config.data.path if config.data.mode == "precomputed" else "(online)"
                bucket_name = f" bucket {bucket['name']}" if len(data.buckets) > 1 else ""
                raise config.error(f"[model] does not fit [data] {where}{bucket_name}: {exc}") from None
        try:  # between the build on meta and the parallelisation: sana2/components/model_transforms.py
            model = apply_transforms(model, build_transforms(config))
        except ValueError as exc:
            raise config.error(str(exc)) from None
        try:
            parallelize_sana(
                model,
                self.dims,
                config.parallelism,
                config.training,
                config.activation_checkpoint,
                config.compile,
                self.cp,
            )
        except ParallelizeError as exc:
            raise config.error(str(exc)) from None
        materialize(model, self.device, config.parallelism.cpu_offload)
        init_weights(model, config.training.seed)  # each rank fills only its own shards
        return model.train()

    def _restore(self) -> None:
        """Resume from a checkpoint; else start from the configured initial weights, if any."""
        ckpt = self.config.checkpoint
        # checkpoints hold no frozen parameter (model_transforms): those come from the initial weights on
        # every start, resumes included (without initial weights, from the seeded initialisation)
        frozen = bool(frozen_parameter_names(self.model))
        if ckpt.initial_load_path and frozen:
            self._load_initial_weights()
        start = time.perf_counter()
        path = self.checkpointer.resume(self.config.resume_target()) if self.checkpointer else None
        if path is not None:  # with the null caption it was saved with
            logger.info(f"resumed from {path} at step {self.step} (loaded in {time.perf_counter() - start:.2f}s)")
            return
        if ckpt.initial_load_path and not frozen:
            self._load_initial_weights()
        if self.null_caption is not None:  # the data's encoder's empty prompt; checkpoints carry it from here
            store_null_caption(self.model, self.null_caption)

    def _load_initial_weights(self) -> None:
        path = self.config.checkpoint.initial_load_path
        kept = load_initial_weights(self.model, path)
        if kept:  # a diffusers folder holds no null caption
            logger.info(f"{', '.join(kept)}: not in {path}; the run's initial value is kept")
        if self.ema is not None:
            self.ema.copy_from_model()  # the average starts from the loaded weights, not the init
        logger.info(f"model weights loaded from {path}")

    def train_step(self) -> StepResult | None:
        """One optimizer step; None when a stop request ends the run at a safe point (one before each
        micro-batch). A partial step is then undone: the data position and the random state are put
        back, and the model, optimizer and schedule were not touched yet."""
        step = self.step + 1
        started = time.perf_counter()
        before = self.loader.state_dict(), capture_rng()
        with self.metrics.waiting_for_data():
            micro_batches = self.loader.next_step()
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        sample_losses, sample_sigmas = [], []
        for index, batch in enumerate(micro_batches):
            if self._stop_decision(step, index, len(micro_batches), started) != GO_ON:
                self.loader.load_state_dict(before[0])
                restore_rng(before[1])
                self.optimizer.zero_grad(set_to_none=True)
                return None
            # gradients are reduce-scattered once per step, after the last micro-batch
            self.model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            # non-blocking: a blocking copy to a GPU waits for everything queued before it
            inputs = {key: value.to(self.device, non_blocking=True) for key, value in batch.items() if key != "indices"}
            draw = self.flow.draw(step, batch["indices"], tuple(inputs["latents"].shape[1:]))
            per_sample = self.flow.loss(self.model, inputs, draw.to(self.device), self.cp)
            (per_sample.mean() / len(micro_batches)).backward()
            loss_sum += per_sample.detach().sum().double()
            sample_losses.append(per_sample.detach())
            sample_sigmas.append(draw.sigma)  # the host's copy
        max_norm = self.config.training.max_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        local_samples = sum(len(b["indices"]) for b in micro_batches)
        loss, samples, grad_norm, losses = self._read_step(loss_sum, local_samples, grad_norm, sample_losses)
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
        self._step_seconds = time.perf_counter() - started
        return StepResult(loss, grad_norm, lr, samples, tokens, losses, torch.cat(sample_sigmas), applied)

    def _stop_decision(self, step: int, index: int, count: int, started: float) -> str:
        """The decision every rank takes at the safe point before micro-batch `index` of `count`."""
        finish = 0.0
        pace = self._step_seconds / count if self._step_seconds else 0.0  # seconds per micro-batch
        if index:  # the time the step still needs: from the last step's pace, else this one's so far
            finish = (pace or (time.perf_counter() - started) / index) * (count - index)
        return self.stop_agreement.poll(finish, step, pace)

    def _read_step(
        self, loss_sum: torch.Tensor, local_samples: int, grad_norm: torch.Tensor, sample_losses: list[torch.Tensor]
    ) -> tuple[float, int, float, torch.Tensor]:
        """The step's global mean loss and sample count (one all-reduce over the loss mesh), its gradient
        norm and this rank's per-sample losses (on the host), read from the device at once: the step's
        only wait for it."""
        totals = torch.stack([loss_sum, torch.full_like(loss_sum, float(local_samples))])
        dist.all_reduce(totals, group=self.dims.loss_mesh.get_group())
        mean = totals[:1] / totals[1:]
        norm = grad_norm.detach().reshape(1).double().to(mean.device, non_blocking=True)  # on the host with CPU offload
        values = torch.cat([mean, totals[1:], norm, *sample_losses]).tolist()
        # every rank of a cp group holds its samples' whole losses: each sample counted cp times
        samples = int(values[1]) // self.dims.cp
        return values[0], samples, values[2], torch.tensor(values[3:], dtype=sample_losses[0].dtype)

    def train(self) -> None:
        config, total = self.config, self.config.training.steps
        if self.validator and config.validation.at_start and self.step == 0:
            self.validator.run(self.step)
        if not self.stop.installed:
            self.stop.install()
        while self.step < total:
            self.metrics.begin_step()
            result = self.train_step()
            if result is None:
                self._save_on_stop()
                break
            self.metrics.end_step(self.step, result, self.train_state.skipped_steps)
            stopping = self.stop_agreement.stopping  # the step is finished: its save comes next
            if self.validator and self.step % config.validation.freq == 0 and not stopping:
                self.validator.run(self.step)
                self.stop_agreement.agree_at_next_safe_point()  # a signal during it is seen at once
            if self.checkpointer and self.checkpointer.should_save(self.step) and self.step < total:
                self.save_checkpoint()
                self.stop_agreement.agree_at_next_safe_point()
        else:
            self.save_checkpoint(final=True)
        if self.checkpointer:
            self.checkpointer.wait()
        self.metrics.close()
        if self.rank == 0 and self.train_state.skipped_steps:
            logger.warning(
                f"{self.train_state.skipped_steps} of the {self.step} steps were skipped for a non-finite loss "
                f"or gradient norm (their updates were not applied; each is logged above)"
            )

    def _save_on_stop(self) -> None:
        if self.checkpointer is None:
            logger.info(f"preempted at step {self.step}; checkpoints are disabled, so nothing was saved")
            return
        self.save_checkpoint(final=True)
        logger.info(f"preempted at step {self.step}, checkpoint step-{self.step} saved")

    def save_checkpoint(self, final: bool = False) -> None:
        """Save this step; a final save (end of training, stop signal) blocks and raises if it fails."""
        if self.checkpointer is None:
            return
        if self.stop_agreement.stopping and self.rank == 0:  # what a kill during this save would leave
            latest = complete_checkpoints(self.checkpointer.folder)
            self.stop_agreement.before_save(self.step, f"checkpoint {latest[-1][1]}" if latest else "no checkpoint")
        seconds = None
        try:
            seconds = self.checkpointer.save(self.step, final=final)
        finally:  # an async save's blocking time is not its duration
            measured = final or self.config.checkpoint.async_mode == "disabled"
            self.stop_agreement.after_save(seconds if measured else None)
        self.metrics.logger.scalars(self.step, {"checkpoint/blocking_seconds": seconds})
        logger.info(f"checkpoint step {self.step}: training blocked {seconds:.2f}s")


# errors a user must fix: one message, exit code 2 (everything else keeps its traceback, exit code 1)
USER_ERRORS = (ConfigError, CheckpointError, DataFormatError, NonFiniteError, DumpFolderInUse, NoSpaceError)


def own_dump_folder(folder: Path) -> DumpFolderLock | None:
    """Global rank 0 takes the dump folder for the whole job; every rank raises DumpFolderInUse if
    another run owns it (collective). Returns rank 0's lock, None elsewhere."""
    lock = DumpFolderLock(folder) if dist.get_rank() == 0 else None
    try:
        run_on_rank0(
            lambda: lock.acquire(),
            lambda exc: str(exc) if isinstance(exc, DumpFolderInUse) else f"dump folder {folder}: {exc}",
            errors=(DumpFolderInUse, OSError),
        )
    except RunOnRank0Error as exc:
        raise DumpFolderInUse(str(exc)) from None
    return lock


def record_user_error(message: str) -> None:
    """Write a user error's message, without a traceback, where torchrun's agent reads a worker's
    error (TORCHELASTIC_ERROR_FILE, in the layout of its ErrorHandler), so the sana2 launcher can
    show it once, also for ranks whose output is not shown."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        error = {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}
        Path(path).write_text(json.dumps({"message": error}))


def main(argv: list[str] | None = None) -> int:
    """Train as the config in `argv` says; returns the exit code. Restores the signal handlers it
    installs (for in-process callers; a worker process runs worker_main)."""
    stop = StopSignal()
    stop.install()
    try:
        return run_worker(argv, stop)
    finally:
        stop.uninstall()


def run_worker(argv: list[str] | None, stop: StopSignal) -> int:
    """`stop`: installed before anything else, so a stop during start-up is obeyed at the first safe
    point; left installed, so that the launcher's or torchrun's SIGTERM to a worker that is already
    ending (another rank failed) does not kill it before it reports its own outcome."""
    init_logger()
    trainer = lock = None
    try:
        config = main_config(argv, pipeline_defaults)
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info(f"config ({config.source}) resolved:\n{config.to_toml()}")
        init_distributed()
        lock = own_dump_folder(Path(config.job.dump_folder))
        trainer = Trainer(config, stop)
        if trainer.rank == 0:
            (Path(config.job.dump_folder) / CONFIG_TOML).write_text(config.to_toml())
        trainer.train()
    except USER_ERRORS as exc:
        logger.error(str(exc))
        record_user_error(str(exc))
        if dist.is_initialized() and dist.get_world_size() > 1:
            tell_the_job(str(exc))  # ranks blocked in a collective with this one will fail: say why
        return USER_ERROR
    except Exception:
        # a collective that failed because another rank stopped for an error the user must fix
        told = told_by_another_rank() if dist.is_initialized() and dist.get_world_size() > 1 else None
        if told is None:
            raise
        logger.error(told)
        record_user_error(told)
        return USER_ERROR
    finally:
        # free the model (its FSDP state holds the process groups) while Python is fully alive: left to
        # interpreter exit, tearing down the gloo groups' threads aborts the process (SIGABRT, ~1 run in 2)
        trainer = None
        gc.collect()
        if lock is not None:
            lock.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def worker_main() -> int:
    """A worker process's entry point (`python -m sana2.train ...` and `sana2-train`, started by the launcher
    or torchrun, or alone as one process); `--help` lists every config key."""
    if wants_help(sys.argv[1:]):
        return print_help("sana2-train" if Path(sys.argv[0]).name == "sana2-train" else "python -m sana2.train")
    stop = StopSignal()
    stop.install()
    try:
        # record: an internal error's traceback also reaches the launcher's failure report
        return record(run_worker)(None, stop)
    finally:
        # Python puts back the default handlers (death by signal) while it finalizes, not ignored ones:
        # the agent's SIGTERM to a worker that is exiting with its own code must not replace that code
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(worker_main())
