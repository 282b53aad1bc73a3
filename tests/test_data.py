"""The data pipeline: feature-dataset format, the distributed loader's sample order, digits, text encoder."""

import errno
import json
import os
import re
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from shard_damage import overwrite_tensor_bytes

from sana2 import staging
from sana2.data import digits as digits_module
from sana2.data import writer as writer_module
from sana2.data.digits import NUMBER_WORDS, build_digits_dataset, load_digits
from sana2.data.features import DataFormatError, FeatureDataset
from sana2.data.loader import DistributedFeatureLoader
from sana2.data.writer import write_feature_dataset
from sana2.encoders.text_encoder import build_text_encoder
from sana2.staging import NoSpaceError

LATENT_SHAPE = (2, 3, 3)
LENGTH, WIDTH = 5, 4


def make_features(num_samples: int, latent_dtype=torch.float32):
    """Features whose latents are filled with their sample id, so a batch reveals which samples it holds."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.arange(num_samples, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, *LATENT_SHAPE)
    latents = (latents + torch.rand(num_samples, *LATENT_SHAPE, generator=generator) / 4).to(latent_dtype)
    embeds = torch.randn(num_samples, LENGTH, WIDTH, generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (num_samples,), generator=generator)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    return latents, embeds, mask


@pytest.fixture
def dataset_dir(tmp_path):
    latents, embeds, mask = make_features(10)
    return write_feature_dataset(
        tmp_path / "ds", latents, embeds, mask, captions=[f"c{i}" for i in range(10)], shard_size=4
    )


# ---------------------------------------------------------------------------------------------
# Format: round trip


@pytest.mark.parametrize("latent_dtype", [torch.float32, torch.bfloat16])
def test_write_read_round_trip_is_bit_exact(tmp_path, latent_dtype):
    latents, embeds, mask = make_features(10, latent_dtype)
    captions = [f"caption {i}" for i in range(10)]
    out = write_feature_dataset(
        tmp_path / "ds", latents, embeds, mask, captions=captions, shard_size=4, metadata={"source": "test"}
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["shards"] == ["shard_00000.safetensors", "shard_00001.safetensors", "shard_00002.safetensors"]
    assert (meta["num_samples"], meta["latent_shape"], meta["caption_length"], meta["caption_dim"]) == (
        10,
        list(LATENT_SHAPE),
        LENGTH,
        WIDTH,
    )
    stored = load_file(out / "shard_00001.safetensors")
    assert stored["latents"].dtype == latent_dtype and torch.equal(stored["latents"], latents[4:8])

    dataset = FeatureDataset(out)
    assert len(dataset) == 10 and dataset.captions == captions and dataset.metadata == {"source": "test"}
    order = [9, 0, 4, 3, 4]  # across shards, out of order, repeated
    batch = dataset.get_batch(order)
    assert set(batch) == {"latents", "caption_embeds", "caption_mask"}
    assert all(t.dtype == torch.float32 for t in batch.values())
    assert torch.equal(batch["latents"], latents[order].float())
    assert batch["caption_embeds"].shape == (5, 1, LENGTH, WIDTH)
    assert torch.equal(batch["caption_embeds"][:, 0], embeds[order])
    assert torch.equal(batch["caption_mask"], mask[order].float())


def test_write_is_atomic_and_refuses_to_clobber(tmp_path, dataset_dir):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temporary directory left behind
    latents, embeds, mask = make_features(3)
    with pytest.raises(FileExistsError, match="ds"):
        write_feature_dataset(dataset_dir, latents, embeds, mask)
    write_feature_dataset(dataset_dir, latents, embeds, mask, overwrite=True)
    assert len(FeatureDataset(dataset_dir)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_write_on_a_full_disk_names_the_path_and_leaves_nothing(tmp_path, monkeypatch):
    latents, embeds, mask = make_features(10)
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000))
    with pytest.raises(NoSpaceError, match=f"no space left on {tmp_path / 'ds'}: needs about"):
        write_feature_dataset(tmp_path / "ds", latents, embeds, mask)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "failure",
    [
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
        OSError(errno.ENOSPC, "No space left on device"),
    ],
    ids=["safetensors", "OSError"],
)
def test_a_disk_that_fills_during_a_write_names_the_path_and_leaves_nothing(tmp_path, monkeypatch, failure):
    latents, embeds, mask = make_features(10)

    def full_disk(*args, **kwargs):
        raise failure

    monkeypatch.setattr(writer_module, "save_file", full_disk)
    expected = f"^no space left on {tmp_path / 'ds'}: needs about \\S+ \\S+( and the filesystem.s overhead)?, .* free$"
    with pytest.raises(NoSpaceError, match=expected):
        write_feature_dataset(tmp_path / "ds", latents, embeds, mask)
    assert not any(tmp_path.iterdir())


def test_write_rejects_inconsistent_inputs(tmp_path):
    latents, embeds, mask = make_features(4)
    with pytest.raises(ValueError, match="caption_mask"):
        write_feature_dataset(tmp_path / "a", latents, embeds, mask[:, :-1])
    with pytest.raises(ValueError, match="samples"):
        write_feature_dataset(tmp_path / "b", latents[:3], embeds, mask)
    with pytest.raises(ValueError, match="0/1"):
        write_feature_dataset(tmp_path / "c", latents, embeds, mask * 2)
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# Format: each violation names the file and the field


def _edit_meta(directory, **changes):
    meta = json.loads((directory / "meta.json").read_text())
    meta.update(changes)
    (directory / "meta.json").write_text(json.dumps(meta))


def _edit_shard(directory, name="shard_00001.safetensors", drop=None, **replace):
    tensors = load_file(directory / name)
    tensors.pop(drop, None)
    tensors.update(replace)
    save_file(tensors, directory / name)


BREAKAGES = {
    "missing directory": (lambda d: d.rename(d.with_name("elsewhere")), ["ds", "does not exist"]),
    "missing meta.json": (lambda d: (d / "meta.json").unlink(), ["meta.json", "missing"]),
    "meta.json not JSON": (lambda d: (d / "meta.json").write_text("{oops"), ["meta.json", "JSON"]),
    "wrong format": (lambda d: _edit_meta(d, format="webdataset"), ["meta.json", "'format'", "sana2-features"]),
    "wrong version": (lambda d: _edit_meta(d, version=0), ["meta.json", "'version'", "expected 1 or 2"]),
    "bad latent_shape": (lambda d: _edit_meta(d, latent_shape=[2, 3]), ["meta.json", "'latent_shape'"]),
    "captions of wrong length": (lambda d: _edit_meta(d, captions=["x"]), ["meta.json", "'captions'"]),
    "num_samples disagrees": (
        lambda d: _edit_meta(d, num_samples=11, captions=["x"] * 11),
        ["meta.json", "'num_samples'", "hold 10 samples"],
    ),
    "shard escapes directory": (lambda d: _edit_meta(d, shards=["../x.safetensors"]), ["meta.json", "'shards'"]),
    "missing shard": (lambda d: (d / "shard_00001.safetensors").unlink(), ["shard_00001.safetensors", "missing"]),
    "missing tensor": (lambda d: _edit_shard(d, drop="caption_mask"), ["shard_00001.safetensors", "'caption_mask'"]),
    "latents vs latent_shape": (
        lambda d: _edit_meta(d, latent_shape=[2, 3, 4]),
        ["shard_00000.safetensors", "'latents'", "[4, 2, 3, 4]"],
    ),
    "embeds vs caption_dim": (
        lambda d: _edit_meta(d, caption_dim=8),
        ["shard_00000.safetensors", "'caption_embeds'", "[4, 5, 8]"],
    ),
    "tensors disagree on n": (
        lambda d: _edit_shard(d, caption_mask=torch.ones(3, LENGTH, dtype=torch.long)),
        ["shard_00001.safetensors", "'caption_mask'", "[4, 5]"],
    ),
    "float mask": (
        lambda d: _edit_shard(d, caption_mask=torch.ones(4, LENGTH)),
        ["shard_00001.safetensors", "'caption_mask'", "dtype"],
    ),
    "garbage shard": (
        lambda d: (d / "shard_00002.safetensors").write_bytes(b"\x13not a safetensors file" * 9),
        ["shard_00002.safetensors", "safetensors"],
    ),
    "truncated shard": (
        lambda d: os.truncate(d / "shard_00002.safetensors", 200),
        ["shard_00002.safetensors", "safetensors"],
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_format_errors_name_file_and_field(dataset_dir, breakage):
    corrupt, expected_fragments = BREAKAGES[breakage]
    corrupt(dataset_dir)
    with pytest.raises(DataFormatError) as error:
        FeatureDataset(dataset_dir)
    for fragment in expected_fragments:
        assert fragment in str(error.value)
    assert isinstance(error.value, ValueError)


def test_mask_values_other_than_0_1_are_rejected_when_read(dataset_dir):
    _edit_shard(dataset_dir, caption_mask=torch.full((4, LENGTH), 2))
    dataset = FeatureDataset(dataset_dir)
    dataset.get_batch([0])  # shard 0 is intact
    with pytest.raises(DataFormatError, match="shard_00001.safetensors: .caption_mask. of sample 5 .*than 0 and 1"):
        dataset.get_batch([5])


def test_garbage_inside_a_version_1_shard_is_named_with_its_tensor(tmp_path):
    folder = write_feature_dataset(tmp_path / "ds", *make_features(300), shard_size=100)  # 100 x 5 x 4 floats
    overwrite_tensor_bytes(folder / "shard_00002.safetensors", "caption_embeds")
    dataset = FeatureDataset(folder)
    dataset.get_batch([0, 150])
    with pytest.raises(DataFormatError, match="shard_00002.safetensors: tensor 'caption_embeds' is corrupt"):
        dataset.get_batch([1, 250])


def test_shards_of_an_earlier_sana2_without_crc32_are_read_and_said_once(dataset_dir, sana2_log):
    for name in ("shard_00000.safetensors", "shard_00002.safetensors"):  # rewritten without metadata
        save_file(load_file(dataset_dir / name), dataset_dir / name)
    dataset = FeatureDataset(dataset_dir)
    latents, _, _ = make_features(10)
    assert torch.equal(dataset.get_batch([0, 9, 5])["latents"], latents[[0, 9, 5]])
    warnings = [r.getMessage() for r in sana2_log.records if "CRC32" in r.getMessage()]
    assert warnings == [
        f"{dataset_dir}: 2 of 3 shards carry no CRC32 (written before sana2 recorded them); "
        "their bytes are not checked when read"
    ]


# ---------------------------------------------------------------------------------------------
# Distributed loader


@pytest.fixture
def loader_dataset(tmp_path):
    return FeatureDataset(write_feature_dataset(tmp_path / "loader", *make_features(50), shard_size=16))


def rank_loaders(dataset, local_batch, accum, world, seed=7):
    return [DistributedFeatureLoader(dataset, local_batch, accum, rank, world, seed) for rank in range(world)]


def global_step(loaders):
    """One step of all ranks, as the ordered global batch: micro-batch by micro-batch, rank by rank."""
    per_rank = [loader.next_step() for loader in loaders]
    accum = len(per_rank[0])
    return torch.cat([per_rank[r][m]["indices"] for m in range(accum) for r in range(len(loaders))])


def test_ranks_partition_the_single_process_global_batch(loader_dataset):
    world, local_batch, accum = 4, 2, 3
    ranks = rank_loaders(loader_dataset, local_batch, accum, world)
    (single,) = rank_loaders(loader_dataset, local_batch * world, accum, 1)
    for _ in range(4):
        per_rank = [loader.next_step() for loader in ranks]
        reference = single.next_step()
        for m in range(accum):
            shards = [per_rank[r][m]["indices"] for r in range(world)]
            assert all(len(s) == local_batch for s in shards)
            assert len(set(torch.cat(shards).tolist())) == world * local_batch  # ranks are disjoint
            assert torch.equal(torch.cat(shards), reference[m]["indices"])  # rank r holds the r-th slice
        for r in range(world):  # the tensors are those samples' features
            micro = per_rank[r][1]
            expected = loader_dataset.get_batch(micro["indices"].tolist())
            assert all(torch.equal(micro[k], expected[k]) for k in expected)
            assert micro["latents"][:, 0, 0, 0].floor().long().tolist() == micro["indices"].tolist()


def test_epochs_are_distinct_permutations_without_repeats(loader_dataset):
    (loader,) = rank_loaders(loader_dataset, 6, 2, 1)  # G = 12: 4 steps per epoch, 2 samples dropped
    assert loader.samples_per_epoch == 48 and loader.epoch == 0
    epochs = []
    for epoch in range(3):
        assert loader.epoch == epoch and loader.state_dict()["position"] == 0
        epochs.append(torch.cat([global_step([loader]) for _ in range(4)]).tolist())
    for order in epochs:
        assert len(order) == 48 and len(set(order)) == 48 and set(order) <= set(range(50))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]


def test_state_dict_resume_gives_identical_batches(loader_dataset):
    original = rank_loaders(loader_dataset, 2, 2, 3)  # G = 12
    for _ in range(3):
        global_step(original)
    states = [loader.state_dict() for loader in original]
    assert states[0] == {"epoch": 0, "position": 36, "global_batch_size": 12} and states.count(states[0]) == 3
    resumed = rank_loaders(loader_dataset, 2, 2, 3)
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    for _ in range(6):  # crosses into epoch 1 and beyond
        expected = [loader.next_step() for loader in original]
        got = [loader.next_step() for loader in resumed]
        for rank_expected, rank_got in zip(expected, got):
            for micro_expected, micro_got in zip(rank_expected, rank_got):
                assert all(torch.equal(micro_expected[k], micro_got[k]) for k in micro_expected)


def test_resume_across_dp_world_sizes_continues_the_global_sequence(loader_dataset):
    (uninterrupted,) = rank_loaders(loader_dataset, 8, 2, 1)  # G = 16, 3 steps per epoch
    reference = [global_step([uninterrupted]) for _ in range(9)]

    got = []
    state = None
    for world, steps in ((4, 2), (2, 3), (1, 4)):  # G stays 16: local batch 2, 4, 8 with 2 micro-batches
        loaders = rank_loaders(loader_dataset, 16 // (2 * world), 2, world)
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
        got += [global_step(loaders) for _ in range(steps)]
        state = loaders[0].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(got, reference)) and len(got) == len(reference)


def test_loader_rejects_mismatched_global_batch_and_tiny_datasets(loader_dataset):
    (saved,) = rank_loaders(loader_dataset, 4, 1, 1)
    saved.next_step()
    (other,) = rank_loaders(loader_dataset, 4, 2, 1)
    with pytest.raises(ValueError, match="global batch size 4.*uses 8"):
        other.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="50 samples"):
        DistributedFeatureLoader(loader_dataset, 13, 2, 0, 2, seed=0)


def test_seed_changes_the_order(loader_dataset):
    (a,) = rank_loaders(loader_dataset, 10, 1, 1, seed=1)
    (b,) = rank_loaders(loader_dataset, 10, 1, 1, seed=2)
    assert not torch.equal(global_step([a]), global_step([b]))


# ---------------------------------------------------------------------------------------------
# Digits


@pytest.fixture(scope="module")
def digits_root(tmp_path_factory):
    return tmp_path_factory.mktemp("digits")


@pytest.fixture(scope="module")
def digits(digits_root):
    train_dir, val_dir = build_digits_dataset(digits_root)
    return FeatureDataset(train_dir), FeatureDataset(val_dir)


def caption_label(caption: str) -> int:
    """The one digit a caption names, as a word or a numeral."""
    named = [NUMBER_WORDS.index(w) for w in re.findall(r"[a-z]+", caption) if w in NUMBER_WORDS]
    named += [int(d) for d in re.findall(r"\b\d\b", caption)]
    assert len(named) == 1, caption
    return named[0]


@pytest.mark.slow
def test_digits_split_shapes_and_pixels(digits):
    train, val = digits
    assert (len(train), len(val)) == (1700, 97)
    pixels, labels = load_digits()
    for dataset, part in ((train, slice(0, 1700)), (val, slice(1700, None))):
        batch = dataset.get_batch(list(range(len(dataset))))
        assert batch["latents"].shape == (len(dataset), 1, 8, 8)
        assert batch["caption_embeds"].shape == (len(dataset), 1, 16, 64)
        assert torch.equal(batch["latents"], pixels[part])
        assert dataset.metadata["labels"] == labels[part].tolist()
    assert pixels.min() == -1 and pixels.max() == 1
    assert torch.equal(pixels * 8, (pixels * 8).round())  # 17 grey levels 0..16 mapped to [-1, 1]
    first_row = [0, 0, 5, 13, 9, 1, 0, 0]  # the first CSV row: a zero
    assert pixels[0, 0, 0].tolist() == [v / 8 - 1 for v in first_row] and labels[0] == 0
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@pytest.mark.slow
def test_digits_captions_name_their_label_and_fit_the_encoder(digits):
    train, val = digits
    for dataset in (train, val):
        assert [caption_label(c) for c in dataset.captions] == dataset.metadata["labels"]
        masks = dataset.get_batch(list(range(len(dataset))))["caption_mask"]
        lengths = torch.tensor([len(c) + 1 for c in dataset.captions])  # one byte per character + end token
        assert (lengths <= 16).all(), "a caption was truncated"
        assert torch.equal(masks, (torch.arange(16) < lengths[:, None]).float())
    assert len(set(train.captions)) >= 40  # several phrasings per digit


@pytest.mark.slow
def test_digits_embeddings_follow_the_caption(digits):
    train, _ = digits
    batch = train.get_batch(list(range(len(train))))
    embeds, masks = batch["caption_embeds"][:, 0], batch["caption_mask"]
    first_of = {}
    for index, caption in enumerate(train.captions):
        first_of.setdefault(caption, index)
        assert torch.equal(embeds[index], embeds[first_of[caption]])  # same caption, same embedding
    distinct = list(first_of.values())
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            real = masks[a].bool() & masks[b].bool()
            assert not torch.allclose(embeds[a][real], embeds[b][real], atol=1e-3)
    padded = masks == 0
    assert padded.any() and (masks[padded] == 0).all()


@pytest.mark.slow
def test_digits_cache_is_reused_and_rebuilt_only_when_needed(digits_root, digits, tmp_path):
    train, _ = digits
    train_dir, val_dir = build_digits_dataset(digits_root)
    assert train_dir == train.path
    assert (train_dir / "meta.json").stat().st_mtime_ns == (train.path / "meta.json").stat().st_mtime_ns
    assert len([p for p in digits_root.iterdir()]) == 1  # no temporary directories left

    # a fresh build elsewhere is bit-identical
    fresh_train, _ = build_digits_dataset(tmp_path / "again")
    everything = list(range(len(train)))
    expected, got = train.get_batch(everything), FeatureDataset(fresh_train).get_batch(everything)
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    # other parameters, other cache
    other_train, _ = build_digits_dataset(tmp_path / "again", val_size=200)
    assert other_train != fresh_train and len(FeatureDataset(other_train)) == 1597

    # a damaged cache is rebuilt
    (fresh_train / "shard_00001.safetensors").unlink()
    rebuilt_train, _ = build_digits_dataset(tmp_path / "again")
    assert rebuilt_train == fresh_train and len(FeatureDataset(rebuilt_train)) == 1700
    # so is one whose bytes changed, and one written before shards carried CRC32s
    overwrite_tensor_bytes(fresh_train / "shard_00000.safetensors", "caption_embeds")
    build_digits_dataset(tmp_path / "again")
    FeatureDataset(fresh_train).check_all_shards()
    save_file(load_file(fresh_train / "shard_00001.safetensors"), fresh_train / "shard_00001.safetensors")
    build_digits_dataset(tmp_path / "again")
    assert FeatureDataset(fresh_train).check_all_shards() == 0


@pytest.mark.slow
def test_digits_build_that_loses_a_race_uses_the_winners_copy(tmp_path, monkeypatch):
    real_write = digits_module._write_digits
    competitor = {}

    def write_while_a_competitor_finishes(out, *args):
        # the competitor starts and finishes while we are still writing
        monkeypatch.setattr(digits_module, "_write_digits", real_write)
        train_dir, _ = build_digits_dataset(tmp_path)
        competitor["meta_mtime"] = (train_dir / "meta.json").stat().st_mtime_ns
        real_write(out, *args)

    monkeypatch.setattr(digits_module, "_write_digits", write_while_a_competitor_finishes)
    train_dir, val_dir = build_digits_dataset(tmp_path)
    assert (train_dir / "meta.json").stat().st_mtime_ns == competitor["meta_mtime"]  # the winner's copy stays
    assert len(FeatureDataset(train_dir)) == 1700 and len(FeatureDataset(val_dir)) == 97
    assert [p.name for p in tmp_path.iterdir()] == [train_dir.parent.name]  # our copy was discarded


@pytest.mark.slow
def test_a_full_disk_during_the_digits_build_names_the_data_folder_and_leaves_no_temporary(tmp_path, monkeypatch):
    real_save = writer_module.save_file
    saved = []

    def full_after_two_shards(tensors, path, *args, **kwargs):
        if len(saved) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        saved.append(path)
        real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(writer_module, "save_file", full_after_two_shards)
    root = tmp_path / "data" / "digits"
    with pytest.raises(NoSpaceError) as error:
        build_digits_dataset(root)
    # the data folder and the size of the whole build (1797 x (64 pixels + 16 x 64 embeddings) floats + masks)
    expected = f"no space left on {root}: needs about 8.05 MB( and the filesystem.s overhead)?, \\S+ \\S+ free"
    assert re.fullmatch(expected, str(error.value)), error.value
    assert list(root.iterdir()) == []
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**6))
    with pytest.raises(NoSpaceError, match=f"^no space left on {root}: needs about 8.05 MB, 1.00 MB free$"):
        build_digits_dataset(root)  # refused before writing anything


# ---------------------------------------------------------------------------------------------
# Text encoder


@pytest.mark.slow
def test_tiny_t5_is_deterministic_and_masks_padding():
    captions = ["digit seven", "the number 7", "a much longer caption than sixteen bytes"]
    torch.manual_seed(123)
    before = torch.rand(3)
    first = build_text_encoder("tiny-t5", 16)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), before)  # building the encoder leaves the global RNG alone
    second = build_text_encoder("tiny-t5", 16)
    (embeds_a, mask_a), (embeds_b, mask_b) = first.encode(captions), second.encode(captions)
    assert first.dim == 64 and embeds_a.shape == (3, 16, 64) and embeds_a.dtype == torch.float32
    assert torch.equal(embeds_a, embeds_b) and torch.equal(mask_a, mask_b)
    assert mask_a.dtype == torch.int64 and mask_a.sum(1).tolist() == [12, 13, 16]
    assert embeds_a.abs().max() < 100 and embeds_a.std() > 0.1
    assert not torch.allclose(embeds_a[0, :12], embeds_a[1, :12], atol=1e-3)
    other_seed, _ = build_text_encoder("tiny-t5", 16, seed=1).encode(captions)
    assert not torch.allclose(other_seed, embeds_a, atol=1e-3)


def test_missing_encoder_directory_is_named(tmp_path):
    missing = tmp_path / "gemma-2-2b-it"
    with pytest.raises(FileNotFoundError, match="gemma-2-2b-it"):
        build_text_encoder(str(missing), 16)
