"""What training measures: memory, cross-rank reductions, loss per noise level, FLOPs.

Every function that communicates is an identity when torch.distributed is not initialised, so
the same code runs in a single plain process.
"""

import os
import re
import resource
import sys

import torch
import torch.distributed as dist

from sana2.log import logger

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


# Dense (no sparsity) bf16 tensor-core peak FLOP/s per GPU, from the vendors' datasheets. Matched
# against torch.cuda.get_device_name in order, most specific first: "H100 PCIe" before "H100",
# "H200" before "H20", "GB200" before "B200", and "L4" as a whole word so that it misses "L40S".
GPU_PEAK_FLOPS = (
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\bH200\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bA100\b", 312e12),
    (r"\bA6000\b", 154.8e12),
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
)


def peak_flops(device: torch.device, configured: float | None = None) -> float | None:
    """The per-device peak FLOP/s for MFU: `configured` if given, else the GPU_PEAK_FLOPS entry of a
    CUDA device; None on a CPU or an unknown GPU (no MFU is logged then)."""
    if configured:
        return float(configured)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, flops in GPU_PEAK_FLOPS:
        if re.search(pattern, name):
            return flops
    logger.warning(f"no peak FLOP/s known for GPU {name!r}: set metrics.peak_flops to log MFU")
    return None
