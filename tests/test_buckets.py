"""Aspect-ratio buckets: Sana's tables, the nearest-ratio rule, and the loader's one-bucket global batches."""

import pytest
import torch

from sana2.data.buckets import ASPECT_RATIO_TABLES, bucket_table, nearest_bucket, single_bucket
from sana2.data.loader import DistributedFeatureLoader, epoch_batches, rank_micro_batches

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


def test_every_table_spans_its_ratios_at_about_constant_area():
    for name, table in ASPECT_RATIO_TABLES.items():
        keys = list(table)
        if "VIDEO" in name:  # Sana-Video's eleven buckets: 1:2 to 2:1
            assert len(keys) == 11 and keys[0] == "0.5" and keys[-1] == "2.0" and "1.0" in keys, name
        else:
            assert len(keys) == 40 and keys[0] == "0.25" and keys[-1] == "4.0" and "1.0" in keys, name
        assert [float(k) for k in keys] == sorted(float(k) for k in keys), name
        base = table["1.0"][0]
        for key, (height, width) in table.items():
            assert abs(height / width - float(key)) < 0.08 * float(key), (name, key)
            assert 0.85 < height * width / base**2 < 1.1, (name, key)
        if "VIDEO" in name:  # whole Wan VAE latents (8x) in patches of 2
            assert all(h % 16 == 0 and w % 16 == 0 for h, w in table.values()), name
        elif base >= 512:  # whole DC-AE f32 latents
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
# Global batches from one bucket (sana2/data/loader.py)

# 3 buckets of 23, 10 and 7 samples, interleaved
BUCKET_IDS = torch.tensor([0] * 23 + [1] * 10 + [2] * 7)[torch.randperm(40, generator=torch.Generator().manual_seed(0))]


class BucketedIds:
    """A dataset whose batches are its samples' indices and buckets (what the loader hands out)."""

    def __init__(self, bucket_ids):
        self.bucket_ids = bucket_ids

    def __len__(self):
        return len(self.bucket_ids)

    def get_batch(self, indices):
        if len(set(self.bucket_ids[indices].tolist())) != 1:
            raise ValueError("a batch must come from one bucket")
        return {"bucket": self.bucket_ids[indices]}


def loaders(world_size: int, local_batch: int, accumulation: int, seed: int = 0, bucket_ids=BUCKET_IDS):
    dataset = BucketedIds(bucket_ids)
    return [
        DistributedFeatureLoader(dataset, local_batch, accumulation, r, world_size, seed) for r in range(world_size)
    ]


def global_batch(rank_loaders) -> torch.Tensor:
    """One step of every rank, as the global batch: micro-batch by micro-batch, rank by rank."""
    per_rank = [loader.next_step() for loader in rank_loaders]
    return torch.cat([per_rank[r][m]["indices"] for m in range(len(per_rank[0])) for r in range(len(per_rank))])


def test_every_global_batch_is_one_bucket_and_an_epoch_never_repeats_a_sample():
    (loader,) = loaders(1, 4, 1)
    sizes = {b: int((BUCKET_IDS == b).sum()) for b in range(3)}
    assert loader.steps_per_epoch == sum(n // 4 for n in sizes.values()) == 8
    for epoch in range(3):
        batches = [global_batch([loader]) for _ in range(loader.steps_per_epoch)]
        seen = torch.cat(batches)
        assert len(set(seen.tolist())) == len(seen)  # no sample twice within an epoch
        assert all(len(set(BUCKET_IDS[batch].tolist())) == 1 for batch in batches)
        per_bucket = {b: sum(1 for batch in batches if BUCKET_IDS[batch[0]] == b) for b in range(3)}
        assert per_bucket == {b: n // 4 for b, n in sizes.items()}
        assert loader.state_dict() == {"epoch": epoch + 1, "position": 0, "global_batch_size": 4}
    # epochs differ, and the buckets are interleaved rather than visited one after another
    first, second = loader.epoch_batches(0), loader.epoch_batches(1)
    assert not torch.equal(first, second)
    order = BUCKET_IDS[first[:, 0]].tolist()
    assert sum(a != b for a, b in zip(order, order[1:])) > 2


def test_order_is_a_function_of_seed_and_epoch_only():
    assert torch.equal(epoch_batches(BUCKET_IDS, 4, 1, 2), epoch_batches(BUCKET_IDS.clone(), 4, 1, 2))
    assert not torch.equal(epoch_batches(BUCKET_IDS, 4, 1, 0), epoch_batches(BUCKET_IDS, 4, 2, 0))
    # renumbering the buckets without reordering them changes nothing (a dataset may leave ids unused)
    assert torch.equal(epoch_batches(BUCKET_IDS, 4, 1, 0), epoch_batches(BUCKET_IDS * 3 + 1, 4, 1, 0))


def test_one_bucket_takes_consecutive_slices_of_one_permutation():
    from sana2.seeding import seeded_generator

    permutation = torch.randperm(40, generator=seeded_generator("loader", 5, 3))
    assert torch.equal(epoch_batches(torch.zeros(40, dtype=torch.long), 8, 5, 3), permutation.view(5, 8))


def test_restart_from_state_dict_sees_the_same_batches():
    (reference,) = loaders(1, 4, 1)
    expected = [global_batch([reference]) for _ in range(20)]  # crosses epochs (8 steps each)
    for stop in (0, 3, 8, 13):
        (first,) = loaders(1, 4, 1)
        got = [global_batch([first]) for _ in range(stop)]
        (resumed,) = loaders(1, 4, 1)
        resumed.load_state_dict(first.state_dict())
        got += [global_batch([resumed]) for _ in range(20 - stop)]
        assert all(torch.equal(x, y) for x, y in zip(got, expected)), stop


@pytest.mark.parametrize("world_size, local_batch", [(1, 8), (2, 4), (4, 2), (2, 2), (4, 1)])
def test_ranks_of_any_world_size_split_the_same_global_batches(world_size, local_batch):
    (single,) = loaders(1, 8, 1)
    accumulation = 8 // (local_batch * world_size)
    ranks = loaders(world_size, local_batch, accumulation)
    for _ in range(12):  # crosses an epoch
        per_rank = [loader.next_step() for loader in ranks]
        assert all(len(micro) == accumulation for micro in per_rank)
        assert all(len(set(m["bucket"].tolist())) == 1 for micro in per_rank for m in micro)
        # micro-batch m of every rank, in rank order, is the m-th slice of the global batch
        rebuilt = torch.cat([per_rank[r][m]["indices"] for m in range(accumulation) for r in range(world_size)])
        assert torch.equal(rebuilt, global_batch([single]))


def test_resume_at_another_world_size_continues_the_same_batches():
    (reference,) = loaders(1, 8, 1)
    expected = [global_batch([reference]) for _ in range(9)]
    got, state = [], None
    for world_size, steps in ((4, 2), (2, 4), (1, 3)):  # G stays 8
        ranks = loaders(world_size, 8 // world_size, 1)
        for loader in ranks:
            if state is not None:
                loader.load_state_dict(state)
        got += [global_batch(ranks) for _ in range(steps)]
        state = ranks[0].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and len(got) == len(expected)


def test_mismatched_state_and_impossible_batches_are_named():
    (loader,) = loaders(1, 4, 1)
    with pytest.raises(ValueError, match="global batch size 4, but this run uses 8"):
        loaders(1, 8, 1)[0].load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="position=32 does not fit"):
        loader.load_state_dict({"epoch": 0, "position": 32, "global_batch_size": 4})
    with pytest.raises(ValueError, match="no bucket holds one global batch of 24.*\\{0: 23, 1: 10, 2: 7\\}"):
        loaders(1, 24, 1)
    with pytest.raises(ValueError, match="does not split into micro-batches of 3 x 2 ranks"):
        rank_micro_batches(torch.arange(8), 3, 0, 2)
