"""Training measurements: cross-rank reductions on 2 gloo ranks, losses per noise level, memory, FLOPs."""

import pytest
import torch
from dist_utils import run_distributed

from sana2.components.stats import (
    TimestepBuckets,
    all_reduce_stats,
    flops_per_sample,
    memory_stats,
    peak_flops,
)

WORLD_SIZE = 2


def rank_values(rank: int) -> dict[str, float]:
    values = {"loss": 0.25 * (rank + 1), "count": float(rank + 3), "negative": -2.0 * rank}
    # rank 1 builds its dict in another order: the reduction must pair values by key
    return values if rank == 0 else dict(reversed(list(values.items())))


def rank_loss_samples(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-rank micro-batches of (per-sample loss, sigma), with bucket edges hit exactly.

    No sigma falls in [0.5, 0.75) on any rank; only rank 0 has samples in [0.75, 1.0], all at
    sigma == 1.0 (the closed upper edge).
    """
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for size in (3, 5, 4):
        sigmas = torch.rand(size, generator=generator, dtype=torch.float64) * 0.5
        batches.append((torch.rand(size, generator=generator), sigmas))
    batches[0][1][0] = 0.25  # a lower edge belongs to the bucket above it
    batches[1][1][1] = 0.0
    if rank == 0:
        batches.append((torch.tensor([0.5, 1.5]), torch.tensor([1.0, 1.0], dtype=torch.float64)))
    return batches


def _reduce_on_ranks(rank, world_size, out_dir):
    values = rank_values(rank)
    reduced = {op: all_reduce_stats(values, op) for op in ("mean", "max", "sum")}
    buckets = TimestepBuckets()
    for losses, sigmas in rank_loss_samples(rank):
        buckets.add(losses, sigmas)
    bucket_means = buckets.reduce()
    after_reset = buckets.reduce()  # nothing added since: every bucket empty on every rank
    torch.save(
        {"reduced": reduced, "bucket_means": bucket_means, "after_reset": after_reset}, out_dir / f"rank{rank}.pt"
    )


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("metrics")
    run_distributed(_reduce_on_ranks, WORLD_SIZE, out_dir)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_all_reduce_stats_mean_max_sum_are_exact(rank_results):
    expected = {
        "mean": {"loss": 0.375, "count": 3.5, "negative": -1.0},
        "max": {"loss": 0.5, "count": 4.0, "negative": 0.0},
        "sum": {"loss": 0.75, "count": 7.0, "negative": -2.0},
    }
    for rank, result in enumerate(rank_results):
        for op, values in expected.items():
            assert result["reduced"][op] == values, (rank, op)
    # each rank gets its values back under its own key order
    assert list(rank_results[1]["reduced"]["sum"]) == list(rank_values(1))


@pytest.mark.slow
def test_timestep_buckets_are_global_means_over_all_ranks_samples(rank_results):
    edges = (0.0, 0.25, 0.5, 0.75, 1.0)
    per_bucket = {i: [] for i in range(4)}
    for rank in range(WORLD_SIZE):
        for losses, sigmas in rank_loss_samples(rank):
            for loss, sigma in zip(losses.tolist(), sigmas.tolist()):
                bucket = sum(sigma >= edge for edge in edges[1:-1])  # sigma == 1.0 stays in the last
                per_bucket[bucket].append(loss)
    expected = {f"loss/sigma_{edges[i]:.2f}-{edges[i + 1]:.2f}": sum(v) / len(v) for i, v in per_bucket.items() if v}
    assert set(expected) == {"loss/sigma_0.00-0.25", "loss/sigma_0.25-0.50", "loss/sigma_0.75-1.00"}
    assert expected["loss/sigma_0.75-1.00"] == 1.0
    for result in rank_results:
        assert result["bucket_means"].keys() == expected.keys()
        for name, mean in expected.items():
            assert result["bucket_means"][name] == pytest.approx(mean, rel=1e-12)
        assert result["after_reset"] == {}


def test_reductions_are_identities_without_a_process_group():
    assert all_reduce_stats({"a": 1.5, "b": torch.tensor(2.0)}, "mean") == {"a": 1.5, "b": 2.0}
    buckets = TimestepBuckets(edges=(0.0, 0.5, 1.0))
    buckets.add(torch.tensor([1.0, 3.0, 10.0]), torch.tensor([0.1, 0.2, 0.9]))
    assert buckets.reduce() == {"loss/sigma_0.00-0.50": 2.0, "loss/sigma_0.50-1.00": 10.0}
    with pytest.raises(ValueError):
        all_reduce_stats({"a": 1.0}, "median")


def test_memory_stats_on_cpu_are_positive_gib():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"memory/peak_rss_gib", "memory/rss_gib"}
    assert all(0 < value < 1024 for value in stats.values())
    assert stats["memory/rss_gib"] <= stats["memory/peak_rss_gib"] * 1.001


def test_flops_and_peak_flops(monkeypatch):
    assert flops_per_sample(1_000_000, 256) == 6 * 1_000_000 * 256
    assert peak_flops(torch.device("cpu"), None) is None
    assert peak_flops(torch.device("cpu"), 1.5e12) == 1.5e12
    names = {
        "NVIDIA H200": 989e12,
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H20": 148e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA L40S": 362e12,
        "NVIDIA L4": 121e12,
        "NVIDIA GeForce GTX 1080": None,  # unknown: no MFU rather than a guess
    }
    for name, flops in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda"), None) == flops, name
