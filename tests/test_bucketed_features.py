"""The feature format's version 2 (one bucket per shard, per-sample latent shapes, the null caption), and
version 1 read as one bucket."""

import json

import pytest
import torch
from safetensors.torch import save_file
from shard_damage import overwrite_tensor_bytes

from sana2.data.features import NULL_CAPTION_FILE, DataFormatError, FeatureDataset, shard_file_name
from sana2.data.writer import write_feature_dataset, write_meta, write_null_caption, write_shard

L, C = 5, 4
SHAPES = [(2, 3, 4), (2, 4, 3)]  # two buckets: wide and tall latents


def write_dataset(folder, sizes=((0, 3), (1, 2), (0, 1)), dtype=torch.float32):
    """Shards of (bucket, n) samples; each latent is filled with its sample number."""
    folder.mkdir(parents=True, exist_ok=True)
    shards, counts, number = [], [0, 0], 0
    for index, (bucket, n) in enumerate(sizes):
        ids = torch.arange(number, number + n, dtype=torch.float32)
        write_shard(
            folder / shard_file_name(index),
            ids.view(-1, 1, 1, 1).expand(n, *SHAPES[bucket]).to(dtype),
            torch.randn(n, L, C).to(dtype),
            (torch.arange(L) < 3).long().expand(n, L),
            [f"key{number + i}" for i in range(n)],
            [f"caption {number + i}" for i in range(n)],
            f"b{bucket}",
        )
        shards.append({"file": shard_file_name(index), "bucket": bucket, "num_samples": n})
        counts[bucket] += n
        number += n
    write_null_caption(folder, torch.full((L, C), 0.5), torch.tensor([1, 0, 0, 0, 0]))
    meta = {
        "format": "sana2-features",
        "version": 2,
        "num_samples": number,
        "caption_length": L,
        "caption_dim": C,
        "buckets": [
            {"name": f"b{b}", "image_size": [s[1] * 8, s[2] * 8], "latent_shape": list(s), "num_samples": counts[b]}
            for b, s in enumerate(SHAPES)
        ],
        "shards": shards,
        "null_caption": NULL_CAPTION_FILE,
    }
    write_meta(folder, meta)
    return folder


def test_round_trip_gives_per_sample_shapes_and_one_bucket_batches(tmp_path):
    dataset = FeatureDataset(write_dataset(tmp_path / "ds", dtype=torch.bfloat16))
    assert len(dataset) == 6 and dataset.bucket_ids.tolist() == [0, 0, 0, 1, 1, 0]
    assert [dataset.latent_shape_of(i) for i in (0, 3, 5)] == [SHAPES[0], SHAPES[1], SHAPES[0]]
    assert dataset.keys == [f"key{i}" for i in range(6)] and dataset.captions[4] == "caption 4"
    batch = dataset.get_batch([5, 0, 2])
    assert batch["latents"].shape == (3, *SHAPES[0]) and batch["latents"].dtype == torch.float32
    assert batch["latents"][:, 0, 0, 0].tolist() == [5, 0, 2]
    assert batch["caption_embeds"].shape == (3, 1, L, C) and batch["caption_mask"][0].tolist() == [1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="must come from one bucket"):
        dataset.get_batch([0, 3])
    embeds, mask = dataset.null_caption()
    assert torch.equal(embeds, torch.full((L, C), 0.5)) and mask.tolist() == [1, 0, 0, 0, 0]


def break_meta(folder, **changes):
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(changes)
    (folder / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"version": 3}, "field 'version' is 3; expected 1 or 2"),
        ({"version": 1}, "field 'latent_shape' is missing"),
        ({"num_samples": 7}, "field 'num_samples' is 7; expected the sum of the shards' num_samples \\(6\\)"),
        ({"buckets": []}, "field 'buckets' is \\[\\]; expected a non-empty list"),
        ({"null_caption": "../x"}, "field 'null_caption'"),
    ],
)
def test_meta_errors_name_the_field(tmp_path, changes, message):
    folder = write_dataset(tmp_path / "ds")
    break_meta(folder, **changes)
    with pytest.raises(DataFormatError, match=message):
        FeatureDataset(folder)


def test_shard_errors_name_the_file(tmp_path):
    folder = write_dataset(tmp_path / "ds")
    meta = json.loads((folder / "meta.json").read_text())
    meta["shards"][1]["bucket"], meta["buckets"][0]["num_samples"], meta["buckets"][1]["num_samples"] = 0, 6, 0
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataFormatError, match="shard_00001.safetensors: tensor 'latents' has shape \\[2, 2, 4, 3\\]"):
        FeatureDataset(folder)
    folder = write_dataset(tmp_path / "other")
    save_file({"latents": torch.zeros(2, *SHAPES[1])}, folder / "shard_00001.safetensors")
    with pytest.raises(DataFormatError, match="shard_00001.safetensors: missing tensor"):
        FeatureDataset(folder)
    (folder / "meta.json").unlink()
    with pytest.raises(DataFormatError, match="meta.json: missing; .*an unfinished one lacks it"):
        FeatureDataset(folder)


def test_write_meta_refuses_what_the_reader_would_refuse(tmp_path):
    with pytest.raises(DataFormatError, match="field 'format'"):
        write_meta(tmp_path, {"format": "other"})
    assert not (tmp_path / "meta.json").exists()


def test_a_version_1_dataset_reads_as_one_bucket(tmp_path):
    latents = torch.arange(5, dtype=torch.float32).view(5, 1, 1, 1).expand(5, *SHAPES[0])
    folder = write_feature_dataset(
        tmp_path / "v1", latents, torch.randn(5, L, C), torch.ones(5, L, dtype=torch.long), shard_size=2
    )
    dataset = FeatureDataset(folder)
    assert dataset.version == 1 and dataset.bucket_ids.tolist() == [0] * 5
    assert dataset.latent_shapes == [SHAPES[0]] and dataset.buckets[0]["name"] == "all"
    assert dataset.keys is None and dataset.null_caption() is None
    assert dataset.get_batch([4, 1])["latents"][:, 0, 0, 0].tolist() == [4, 1]


def test_garbage_inside_a_shard_stops_at_its_first_read_naming_the_shard_and_the_tensor(tmp_path):
    folder = write_dataset(tmp_path / "ds", sizes=((0, 60), (1, 60)))
    overwrite_tensor_bytes(folder / "shard_00001.safetensors", "caption_embeds")  # of 60 x 5 x 4 floats: 4800 B
    dataset = FeatureDataset(folder)  # opening reads headers only: a big dataset starts at once
    assert dataset.get_batch([0, 59])["latents"].shape[0] == 2  # shard 0 is intact
    expected = "shard_00001.safetensors: tensor 'caption_embeds' is corrupt: its bytes do not match their CRC32"
    with pytest.raises(DataFormatError, match=expected):
        dataset.get_batch([60])
    with pytest.raises(DataFormatError, match=expected):  # not marked checked by a failed check
        dataset.get_batch([61])


def test_a_damaged_null_caption_is_named(tmp_path):
    folder = write_dataset(tmp_path / "ds")
    overwrite_tensor_bytes(folder / NULL_CAPTION_FILE, "caption_embeds", size=16)
    with pytest.raises(DataFormatError, match="null_caption.safetensors: tensor 'caption_embeds' is corrupt"):
        FeatureDataset(folder).null_caption()
