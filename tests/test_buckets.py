"""Aspect-ratio buckets: Sana's tables, the nearest-ratio rule, and the bucketed batch sampler."""

import pytest
import torch

from sana2.data.bucket_sampler import BucketBatchSampler, rank_micro_batches
from sana2.data.buckets import ASPECT_RATIO_TABLES, bucket_table, nearest_bucket, single_bucket

# ---------------------------------------------------------------------------------------------
# Tables


@pytest.mark.parametrize(
    "table, key, size",
    [
        # entries as Sana's diffusion/data/datasets/utils.py lists them
        ("ASPECT_RATIO_512", "0.57", (384, 672)),
        ("ASPECT_RATIO_512", "1.0", (512, 512)),
        ("ASPECT_RATIO_512", "3.62", (928, 256)),
        ("ASPECT_RATIO_1024", "0.25", (512, 2048)),
        ("ASPECT_RATIO_1024", "1.46", (1216, 832)),
        ("ASPECT_RATIO_1024", "2.89", (1664, 576)),
        ("ASPECT_RATIO_2048", "0.68", (1664, 2432)),
        ("ASPECT_RATIO_4096", "4.0", (8192, 2048)),
        ("ASPECT_RATIO_256", "0.82", (224, 272)),
        ("ASPECT_RATIO_128", "2.09", (184, 88)),
        ("ASPECT_RATIO_2880", "0.47", (1920, 4096)),
        ("ASPECT_RATIO_2880", "1.7", (3584, 2112)),
    ],
)
def test_tables_hold_sanas_values(table, key, size):
    assert ASPECT_RATIO_TABLES[table][key] == size


def test_every_table_spans_ratios_a_quarter_to_four_at_about_constant_area():
    for name, table in ASPECT_RATIO_TABLES.items():
        keys = list(table)
        assert len(keys) == 40 and keys[0] == "0.25" and keys[-1] == "4.0" and "1.0" in keys, name
        assert [float(k) for k in keys] == sorted(float(k) for k in keys), name
        base = table["1.0"][0]
        for key, (height, width) in table.items():
            assert abs(height / width - float(key)) < 0.08 * float(key), (name, key)
            assert 0.85 < height * width / base**2 < 1.1, (name, key)
        if base >= 512:  # whole DC-AE f32 latents
            assert all(h % 32 == 0 and w % 32 == 0 for h, w in table.values()), name


def test_nearest_bucket_compares_height_over_width_with_the_ratio_keys():
    buckets = bucket_table("ASPECT_RATIO_1024")
    name = lambda h, w: buckets[nearest_bucket(h, w, buckets)].name  # noqa: E731
    assert name(1000, 1000) == "1.0"
    assert name(1080, 1920) == "0.57"  # 0.5625: nearer 0.57 than 0.52
    assert name(1920, 1080) == "1.75"  # 1.78
    assert name(100, 1000) == "0.25" and name(1000, 100) == "4.0"  # beyond the table: its ends
    assert name(549, 1000) == "0.57" and name(543, 1000) == "0.52"
    with pytest.raises(ValueError, match="unknown aspect-ratio table 'ASPECT_RATIO_999'"):
        bucket_table("ASPECT_RATIO_999")
    assert [(b.height, b.width) for b in single_bucket(256, 384)] == [(256, 384)]


# ---------------------------------------------------------------------------------------------
# Sampler

# 3 buckets of 23, 10 and 7 samples, interleaved
BUCKET_IDS = torch.tensor([0] * 23 + [1] * 10 + [2] * 7)[torch.randperm(40, generator=torch.Generator().manual_seed(0))]


def test_every_global_batch_is_one_bucket_and_an_epoch_never_repeats_a_sample():
    sampler = BucketBatchSampler(BUCKET_IDS, global_batch_size=4, seed=0)
    sizes = {b: int((BUCKET_IDS == b).sum()) for b in range(3)}
    assert sampler.steps_per_epoch == sum(n // 4 for n in sizes.values())
    for epoch in range(3):
        batches = [sampler.next_batch() for _ in range(sampler.steps_per_epoch)]
        seen = torch.cat(batches)
        assert len(set(seen.tolist())) == len(seen)  # no sample twice within an epoch
        for batch in batches:
            assert len(set(BUCKET_IDS[batch].tolist())) == 1
        per_bucket = {b: sum(1 for batch in batches if BUCKET_IDS[batch[0]] == b) for b in range(3)}
        assert per_bucket == {b: n // 4 for b, n in sizes.items()}
        assert sampler.epoch == epoch + 1 and sampler.step_in_epoch == 0
    # epochs differ, and the buckets are interleaved rather than visited one after another
    first, second = sampler.epoch_batches(0), sampler.epoch_batches(1)
    assert not torch.equal(first, second)
    order = BUCKET_IDS[first[:, 0]].tolist()
    assert sum(a != b for a, b in zip(order, order[1:])) > 2


def test_order_is_a_function_of_seed_and_epoch_only():
    a = BucketBatchSampler(BUCKET_IDS, 4, seed=1)
    b = BucketBatchSampler(BUCKET_IDS.clone(), 4, seed=1)
    assert torch.equal(a.epoch_batches(2), b.epoch_batches(2))
    assert not torch.equal(a.epoch_batches(0), BucketBatchSampler(BUCKET_IDS, 4, seed=2).epoch_batches(0))


def test_restart_from_state_dict_sees_the_same_batches():
    reference = BucketBatchSampler(BUCKET_IDS, 4, seed=0)
    expected = [reference.next_batch() for _ in range(20)]  # crosses epochs (8 steps each)
    for stop in (0, 3, 8, 13):
        first = BucketBatchSampler(BUCKET_IDS, 4, seed=0)
        got = [first.next_batch() for _ in range(stop)]
        resumed = BucketBatchSampler(BUCKET_IDS, 4, seed=0)
        resumed.load_state_dict(first.state_dict())
        got += [resumed.next_batch() for _ in range(20 - stop)]
        assert all(torch.equal(x, y) for x, y in zip(got, expected)), stop


@pytest.mark.parametrize("world_size, local_batch", [(1, 8), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_ranks_of_any_world_size_split_the_same_global_batches(world_size, local_batch):
    sampler = BucketBatchSampler(BUCKET_IDS, 8, seed=0)
    for _ in range(5):
        batch = sampler.next_batch()
        per_rank = [rank_micro_batches(batch, local_batch, rank, world_size) for rank in range(world_size)]
        accumulation = 8 // (local_batch * world_size)
        assert all(len(micro) == accumulation for micro in per_rank)
        # micro-batch m of every rank, in rank order, is the m-th slice of the global batch
        rebuilt = torch.cat([per_rank[r][m] for m in range(accumulation) for r in range(world_size)])
        assert torch.equal(rebuilt, batch)
        assert all(len(set(BUCKET_IDS[m].tolist())) == 1 for micro in per_rank for m in micro)


def test_mismatched_state_and_impossible_batches_are_named():
    sampler = BucketBatchSampler(BUCKET_IDS, 4, seed=0)
    with pytest.raises(ValueError, match="global batch size 4, this run uses 8"):
        BucketBatchSampler(BUCKET_IDS, 8, seed=0).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="saved for 40 samples, this dataset has 39"):
        BucketBatchSampler(BUCKET_IDS[:39], 4, seed=0).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="no bucket holds a full global batch of 24"):
        BucketBatchSampler(BUCKET_IDS, 24, seed=0)
    with pytest.raises(ValueError, match="does not split into micro-batches of 3 x 2 ranks"):
        rank_micro_batches(torch.arange(8), 3, 0, 2)
