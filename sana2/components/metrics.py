"""Training metrics: the processor that times steps and assembles what is logged, the trackers it logs to
(TensorBoard, Weights & Biases), the console.

Model-agnostic: the trainer feeds the processor each step's numbers; the processor adds timing,
throughput, MFU, memory and per-noise-level losses, reduces them over ranks and logs them. Every value
goes through one `MetricLogger`, which hands it to each tracker [metrics] enables, on rank 0.
"""

import html
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from sana2.components.sampling import make_grid
from sana2.components.stats import TimestepBuckets, all_reduce_stats, flops_per_sample, memory_stats, peak_flops
from sana2.distributed.parallel_dims import ParallelDims
from sana2.log import logger


@dataclass
class StepResult:
    """What one optimizer step reports."""

    loss: float  # mean over the step's samples on all ranks
    grad_norm: float  # the global norm, before clipping
    lr: float  # the lr the step ran at
    samples: int  # over all ranks
    tokens: int  # over all ranks
    sample_losses: torch.Tensor  # this rank's per-sample losses [n] (on the host)
    sample_sigmas: torch.Tensor  # their noise levels [n] (on the host)
    applied: bool  # finite loss and gradient norm: the update was applied


class MetricsProcessor:
    """Times training steps and logs, every `log_freq` steps, the values of that window.

    A window spans the steps since the previous log (training steps only: saves and validation
    are not in it): its mean step time, the share of it spent waiting for data, samples and tokens
    per second, MFU, peak memory (the max over ranks and rank 0's), the loss per noise level.
    The eta extrapolates this run's mean step time. Logging is a collective: every rank calls
    `end_step` for every step.
    """

    def __init__(
        self,
        settings,
        dims: ParallelDims,
        device: torch.device,
        num_params: int,
        *,
        total_steps: int,
        dump_folder: str | Path,
        config_text: str,
    ):
        """From the [metrics] section `settings`, for a run of `total_steps` over the ranks of `dims` (the
        loss per noise level is averaged over its data ranks); the trackers (`build_trackers`) begin with
        `config_text` (the run's config, JSON)."""
        self.settings, self.total_steps, self.dims = settings, total_steps, dims
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size, self.device = dims.world_size, device
        self.num_params = num_params
        self.peak_flops = peak_flops(device, self.settings.peak_flops or None)
        self.logger = MetricLogger(build_trackers(settings, self.rank, Path(dump_folder), config_text))
        self.logger.text("config", f"```\n{config_text}\n```")
        self.buckets = TimestepBuckets()
        self._window = _Window()
        self._run = _Window()  # this run (since start or resume), for the eta
        self._step_start = time.perf_counter()
        self._data_seconds = 0.0

    @contextmanager
    def waiting_for_data(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._data_seconds += time.perf_counter() - start

    def begin_step(self) -> None:
        self._step_start = time.perf_counter()
        self._data_seconds = 0.0

    def end_step(self, step: int, result: StepResult, skipped_steps: int) -> None:
        seconds = time.perf_counter() - self._step_start
        for window in (self._window, self._run):
            window.add(seconds, self._data_seconds, result.samples, result.tokens)
        if result.applied:  # a skipped step's losses are not finite
            self.buckets.add(result.sample_losses, result.sample_sigmas)
        if step % self.settings.log_freq == 0 or step == self.total_steps:
            self._log(step, result, skipped_steps)
            self._window = _Window()

    def _log(self, step: int, result: StepResult, skipped_steps: int) -> None:
        window = self._window
        memory = memory_stats(self.device)
        memory_max = all_reduce_stats(memory, "max")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # each log reports its own window's peak
        values = {
            "loss": result.loss,
            "grad_norm": result.grad_norm,
            "lr": result.lr,
            "skipped_steps": float(skipped_steps),
            "step_seconds": window.seconds / window.steps,
            "data_wait_share": window.data_seconds / window.seconds,
            "samples_per_second": window.samples / window.seconds,
            "tokens_per_second": window.tokens / window.seconds,
            **self.buckets.reduce(self.dims.data_mesh.get_group() if dist.is_initialized() else None),
            **{k.replace("memory/", "memory/max_over_ranks/"): v for k, v in memory_max.items()},
            **{k.replace("memory/", "memory/rank0/"): v for k, v in memory.items()},
        }
        if self.peak_flops:
            achieved = flops_per_sample(self.num_params, window.tokens) / window.seconds
            values["mfu"] = achieved / (self.peak_flops * self.world_size)
        self.logger.scalars(step, values)
        if self.rank == 0:
            eta = self._run.seconds / self._run.steps * (self.total_steps - step)
            logger.info(format_log_line(step, self.total_steps, {**values, **memory_max}, eta))
            if values["data_wait_share"] > self.settings.slow_data_warning:
                logger.warning(f"data loading took {values['data_wait_share']:.0%} of the step time")

    def close(self) -> None:
        self.logger.close()


@dataclass
class _Window:
    steps: int = 0
    seconds: float = 0.0
    data_seconds: float = 0.0
    samples: int = 0
    tokens: int = 0

    def add(self, seconds: float, data_seconds: float, samples: int, tokens: int) -> None:
        self.steps += 1
        self.seconds += seconds
        self.data_seconds += data_seconds
        self.samples += samples
        self.tokens += tokens


# -- trackers ------------------------------------------------------------------------------------
class TrackerError(ValueError):
    """A tracker [metrics] enables cannot start; the message names the key and what to do."""


class Tracker(Protocol):
    """Where logged values go. The `MetricLogger` calls each tracker alike, on rank 0 only."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def image(self, tag: str, grid: torch.Tensor, step: int) -> None:
        """`grid` [C, H, W] (C = 1 or 3), float in [0, 1] on the CPU."""

    def close(self) -> None: ...


class TensorBoardTracker:
    """TensorBoard event files in `log_dir`."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported only where it writes

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)  # rendered as markdown
        self.writer.flush()

    def image(self, tag: str, grid: torch.Tensor, step: int) -> None:
        self.writer.add_image(tag, grid, step, dataformats="CHW")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run under <folder>/wandb/, holding the run's config. Online it needs a login
    (`wandb login` or WANDB_API_KEY); WANDB_MODE=offline keeps the run on disk (`wandb sync` uploads it)."""

    def __init__(self, folder: Path, project: str, name: str, config: dict):
        import wandb  # an optional dependency: checked with the config (Metrics.enable_wandb)

        self.wandb = wandb
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=project, name=name, dir=str(folder), config=config)
        except Exception as exc:  # wandb raises its own errors (no login, no network) at start-up
            raise TrackerError(
                f"metrics.enable_wandb: Weights & Biases did not start: {exc} (log in with `wandb login`, or set "
                "WANDB_MODE=offline to keep the run on disk)"
            ) from None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({tag: float(value) for tag, value in values.items()}, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def image(self, tag: str, grid: torch.Tensor, step: int) -> None:
        pixels = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        self.run.log({tag: self.wandb.Image(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_trackers(settings, rank: int, dump_folder: Path, config_text: str) -> list[Tracker]:
    """The trackers the [metrics] section `settings` enables, on rank 0 (none elsewhere): TensorBoard into
    <dump_folder>/tb/<start time>/, Weights & Biases into <dump_folder>/wandb/ (project metrics.wandb_project,
    the run named after the dump folder)."""
    if rank != 0:
        return []
    trackers: list[Tracker] = []
    if settings.enable_tensorboard:
        trackers.append(TensorBoardTracker(dump_folder / "tb" / datetime.now().strftime("%Y%m%d-%H%M%S")))
    if settings.enable_wandb:
        name = Path(os.path.abspath(dump_folder)).name
        trackers.append(WandbTracker(dump_folder, settings.wandb_project, name, json.loads(config_text)))
    return trackers


class MetricLogger:
    """Logs through every tracker given (rank 0's; on other ranks there are none and every call is a no-op)."""

    def __init__(self, trackers: list[Tracker] = ()):
        self.trackers = list(trackers)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tracker in self.trackers:
            tracker.scalars(step, values)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Free text (e.g. the resolved config); TensorBoard renders it as markdown."""
        for tracker in self.trackers:
            tracker.text(tag, text, step)

    def images(self, tag: str, images: torch.Tensor, step: int, nrow: int = 8) -> None:
        """Log images [N, C, H, W] with values in [-1, 1] (C = 1 or 3) as one grid image."""
        if not self.trackers:
            return
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be [N, 1 or 3, H, W], got {tuple(images.shape)}")
        unit = ((images.detach().float().cpu() + 1) / 2).clamp(0, 1)
        grid = make_grid(unit, nrow, padding=1, pad_value=1.0)
        for tracker in self.trackers:
            tracker.image(tag, grid, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


# -- console -------------------------------------------------------------------------------------
def format_duration(seconds: float) -> str:
    """45s, 1m23s, 2h05m."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _format_rate(samples_per_second: float) -> str:
    return f"{samples_per_second:.1f}" if samples_per_second < 10 else f"{samples_per_second:,.0f}"


# (metrics key, label, formatter), in the order they print; missing keys are left out
_LOG_LINE_FIELDS = (
    ("loss", "loss", "{:.4f}".format),
    ("grad_norm", "grad_norm", "{:.2f}".format),
    ("lr", "lr", "{:.1e}".format),
    ("samples_per_second", "samples/s", _format_rate),
    ("mfu", "mfu", "{:.1%}".format),
)
# the first of these present is the memory figure shown (peak reserved on CUDA, peak RSS on CPU)
_MEMORY_KEYS = ("memory/max_reserved_gib", "memory/peak_rss_gib")


def format_log_line(step: int, total_steps: int, metrics: dict[str, float], eta_seconds: float | None) -> str:
    """One console line, e.g.
    `step  40/300  loss 0.4123  grad_norm 1.23  lr 2.0e-04  samples/s 812  mem 0.42GiB  eta 1m23s`.

    Reads metrics keys "loss", "grad_norm", "lr", "samples_per_second", "mfu" (a fraction) and a
    memory_stats key; any of them may be missing (and a non-finite value prints as is).
    """
    fields = [f"step {step:>{len(str(total_steps))}}/{total_steps}"]
    for key, label, formatter in _LOG_LINE_FIELDS:
        if key in metrics:
            value = float(metrics[key])
            fields.append(f"{label} {formatter(value) if math.isfinite(value) else value}")
    memory_key = next((key for key in _MEMORY_KEYS if key in metrics), None)
    if memory_key is not None:
        fields.append(f"mem {float(metrics[memory_key]):.2f}GiB")
    if eta_seconds is not None:
        fields.append(f"eta {format_duration(eta_seconds)}")
    return "  ".join(fields)
