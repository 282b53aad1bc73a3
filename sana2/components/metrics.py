"""Training metrics: memory, cross-rank reductions, loss per noise level, FLOPs, TensorBoard, console.

Model-agnostic: the trainer computes the numbers, this module reduces, logs and formats them.
Every function that communicates is an identity when torch.distributed is not initialised, so
the same code runs in a single plain process.
"""

import math
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sana2.components.validation import make_grid

GIB = 1024**3


# -- memory --------------------------------------------------------------------------------------
def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except OSError:
        return None  # no procfs (macOS): only the peak is known
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def memory_stats(device: torch.device) -> dict[str, float]:
    """Memory in GiB. CUDA: the allocator's peaks since the last reset
    ("memory/max_allocated_gib", "memory/max_reserved_gib"); CPU: this process's peak and current
    resident set ("memory/peak_rss_gib", "memory/rss_gib")."""
    if device.type == "cuda":
        return {
            "memory/max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "memory/max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    stats = {"memory/peak_rss_gib": _peak_rss_bytes() / GIB}
    current = _current_rss_bytes()
    if current is not None:
        stats["memory/rss_gib"] = current / GIB
    return stats


# -- cross-rank reductions -----------------------------------------------------------------------
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _collective_device(group) -> torch.device:
    """nccl reduces CUDA tensors only; gloo (and a "cpu:gloo,cuda:nccl" group) takes CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_stats(values: dict[str, float], op: str, group=None) -> dict[str, float]:
    """Reduce every value across the ranks of `group` with one collective; op: mean, max or sum.

    Every rank must pass the same keys. Values travel in float64, so sums of counts and means of
    ordinary scalars are exact. Without an initialised process group the values come back as is.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    if not _distributed():
        return {key: float(value) for key, value in values.items()}
    keys = sorted(values)  # one layout on every rank, whatever order each built its dict in
    packed = torch.tensor([float(values[key]) for key in keys], dtype=torch.float64, device=_collective_device(group))
    dist.all_reduce(packed, op=_REDUCE_OPS[op], group=group)
    if op == "mean":
        packed /= dist.get_world_size(group)
    reduced = dict(zip(keys, packed.tolist()))
    return {key: reduced[key] for key in values}


class TimestepBuckets:
    """The training loss split by noise level: per-sample losses summed into sigma buckets.

    `add` each micro-batch's per-sample losses with their sigmas (no host sync: the sums stay on
    the losses' device); `reduce` all-reduces sums and counts, so each bucket's mean is over all
    ranks' samples, then starts the next interval empty. Bucket i holds edges[i] <= sigma <
    edges[i + 1]; the last bucket also holds sigma == edges[-1].
    """

    def __init__(self, edges: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)):
        if len(edges) < 2 or list(edges) != sorted(edges):
            raise ValueError(f"edges must be at least two increasing values, got {edges}")
        self.edges = tuple(float(edge) for edge in edges)
        self.names = [f"loss/sigma_{low:.2f}-{high:.2f}" for low, high in zip(self.edges[:-1], self.edges[1:])]
        self._inner_edges = torch.tensor(self.edges[1:-1], dtype=torch.float64)
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def add(self, losses: torch.Tensor, sigmas: torch.Tensor) -> None:
        """losses, sigmas: [B] (per-sample loss and the sigma it was computed at)."""
        losses = losses.detach().reshape(-1).double()
        sigmas = sigmas.detach().reshape(-1).to(losses.device, torch.float64)
        bucket = torch.bucketize(sigmas, self._inner_edges.to(losses.device), right=True)
        if self._sums is None:
            self._sums = losses.new_zeros(len(self.names))
            self._counts = losses.new_zeros(len(self.names))
        self._sums.index_add_(0, bucket, losses)
        self._counts.index_add_(0, bucket, torch.ones_like(losses))

    def reduce(self, group=None) -> dict[str, float]:
        """{bucket name: global mean loss}, buckets with no sample on any rank left out; resets.

        A collective: every rank must call it, also a rank that added nothing.
        """
        num_buckets = len(self.names)
        device = _collective_device(group) if _distributed() else torch.device("cpu")
        if self._sums is None:
            totals = torch.zeros(2 * num_buckets, dtype=torch.float64, device=device)
        else:
            totals = torch.cat([self._sums, self._counts]).to(device)
        if _distributed():
            dist.all_reduce(totals, group=group)
        self._sums = self._counts = None
        sums, counts = totals.tolist()[:num_buckets], totals.tolist()[num_buckets:]
        return {name: total / count for name, total, count in zip(self.names, sums, counts) if count > 0}


# -- FLOPs ---------------------------------------------------------------------------------------
def flops_per_sample(num_params: int, tokens_per_sample: int) -> float:
    """Training FLOPs of one sample: 6 * params * tokens (2 forward + 4 backward per weight and token).

    This is the dense-transformer estimate of the matmuls with the weights. Attention adds
    tokens-squared terms to softmax models, but Sana's linear attention costs only O(tokens * D)
    per layer beyond its projections (the D x D key-value summary, applied to each token),
    small next to the weight matmuls, so the standard estimate stands. Cross-attention to the
    caption (L tokens) adds O(tokens * L * D) per layer, also left out, as usual.
    """
    return 6.0 * num_params * tokens_per_sample


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets. Word-bounded patterns,
# most specific first: "H100 PCIe" before "H100", and "L4" must not match "L40S".
def peak_flops(device: torch.device, configured: float | None = None) -> float | None:
    """The per-device peak FLOP/s for MFU: `configured` if given, else torchtitan's table of dense
    bf16 peaks by GPU name (it falls back to A100's with a warning), else None on a CPU (no MFU)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    from torchtitan.tools.utils import get_peak_flops

    return get_peak_flops(torch.cuda.get_device_name(device))


# -- TensorBoard ---------------------------------------------------------------------------------
class MetricLogger:
    """TensorBoard writer on rank 0 (into `log_dir`); on other ranks, or without a log_dir, a no-op."""

    def __init__(self, log_dir: Path | None, rank: int):
        self.writer = None
        if rank == 0 and log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imported only where it writes

            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        """Free text (e.g. the resolved config); TensorBoard renders it as markdown."""
        if self.writer is not None:
            self.writer.add_text(tag, text, step)
            self.writer.flush()

    def images(self, tag: str, images: torch.Tensor, step: int, nrow: int = 8) -> None:
        """Log images [N, C, H, W] with values in [-1, 1] (C = 1 or 3) as one grid image."""
        if self.writer is None:
            return
        if images.dim() != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"images must be [N, 1 or 3, H, W], got {tuple(images.shape)}")
        unit = ((images.detach().float().cpu() + 1) / 2).clamp(0, 1)
        self.writer.add_image(tag, make_grid(unit, nrow, padding=1, pad_value=1.0), step, dataformats="CHW")
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


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
