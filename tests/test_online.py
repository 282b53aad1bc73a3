"""Training from images and captions: online encoding equals precomputation, bucketed training resumes
exactly at another world size, validation decodes with the VAE, the null caption goes into the model."""

import json
import os
import re
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from dist_utils import run_distributed
from encoder_factory import TINY_DC_AE_F8, image_bytes, save_tiny_dc_ae
from train_utils import TINY, full_model_state, run_steps, tiny_config

from sana2.config import ConfigError, load_config
from sana2.data import online
from sana2.data.features import DataFormatError, FeatureDataset
from sana2.data.online import build_online_dataset
from sana2.distributed.parallel_dims import ParallelDims
from sana2.encoders.text_encoder import build_text_encoder
from sana2.prepare import PrepareOptions, prepare

STEPS = 4
# a 4-channel latent model reading tiny-t5 captions; global batches of 4 from the buckets below
MODEL = ["--model.in_channels=4", "--training.global_batch_size=4"]


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    """Images of three ASPECT_RATIO_128 buckets ("0.5": 4, "0.94": 5, "1.0": 3), a truncated image and an
    uncaptioned one; an 8x VAE; and the dataset sana2-prepare makes of them (float32 features)."""
    root = tmp_path_factory.mktemp("online")
    save_tiny_dc_ae(root / "vae", config=TINY_DC_AE_F8)
    images = root / "images"
    images.mkdir()
    for i in range(8):
        (images / f"square{i}.png").write_bytes(image_bytes(96 + i, 96, i))
        (images / f"square{i}.txt").write_text(f"a square picture {i}")
    for i in range(4):
        (images / f"wide{i}.png").write_bytes(image_bytes(160, 80, 10 + i))
        (images / f"wide{i}.txt").write_text(f"a wide picture {i}")
    cut = image_bytes(64, 64, 99)
    (images / "cut.png").write_bytes(cut[: len(cut) // 2])
    (images / "cut.txt").write_text("cut short")
    (images / "uncaptioned.png").write_bytes(image_bytes(64, 64, 98))
    # the [encoding] section online mode reads, with its defaults (float32 encoders among them)
    config = load_config(None, online_overrides(root))
    options = PrepareOptions(
        inputs=[str(images)],
        output=str(root / "prepared"),
        encoding=config.encoding,
        max_length=config.caption_length,
        feature_dtype="float32",
        batch_size=3,
        shard_size=2,
    )
    assert prepare(options).encoded == 12
    return root


def online_overrides(root: Path) -> list[str]:
    return [
        "--data.mode=online",
        f'--data.inputs=["{root / "images"}"]',
        f"--encoding.vae={root / 'vae'}",
        "--encoding.buckets=ASPECT_RATIO_128",
        "--encoding.workers=0",
    ]


EXPECTED_SKIPS = {
    "cut.png": "corrupt or truncated image (image file is truncated)",
    "uncaptioned.png": "no caption (looked for: prompt)",
}


@pytest.mark.slow
def test_online_samples_are_the_precomputed_samples(material, tmp_path, monkeypatch):
    config = load_config(None, online_overrides(material))
    online_args = (config.data.inputs, config.encoding, config.caption_length)
    dataset = build_online_dataset(*online_args, ParallelDims(1, 1), torch.device("cpu"), tmp_path)
    prepared = FeatureDataset(material / "prepared")
    assert dataset.keys == prepared.keys and dataset.captions == prepared.captions
    assert torch.equal(dataset.bucket_ids, prepared.bucket_ids) and dataset.buckets == prepared.buckets
    assert [b["num_samples"] for b in dataset.buckets] == [4, 5, 3]
    for bucket in range(3):
        indices = torch.nonzero(dataset.bucket_ids == bucket).flatten().tolist()
        got, expected = dataset.get_batch(indices), prepared.get_batch(indices)
        assert got["latents"].shape == (len(indices), *prepared.latent_shapes[bucket])
        # the VAE's convolutions round differently for other batch compositions; the text encoder does not
        torch.testing.assert_close(got["latents"], expected["latents"], atol=1e-5, rtol=0)
        assert torch.equal(got["caption_embeds"], expected["caption_embeds"])
        assert torch.equal(got["caption_mask"], expected["caption_mask"])
    null_embeds, null_mask = dataset.null_caption()
    assert torch.equal(null_embeds, prepared.null_caption()[0]) and torch.equal(null_mask, prepared.null_caption()[1])
    # skipped inputs: listed with their paths and reasons, as sana2-prepare lists them
    report = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS
    assert report == [json.loads(line) for line in (material / "prepared" / "skipped.jsonl").read_text().splitlines()]
    # a second start finds the images already checked: nothing is decoded before training
    monkeypatch.setattr(online, "decode_image", lambda *args: pytest.fail("decoded again"))
    again = build_online_dataset(*online_args, ParallelDims(1, 1), torch.device("cpu"), tmp_path)
    assert again.keys == dataset.keys


def _build_with_cp(rank, world_size, root, dump, out):
    config = load_config(None, online_overrides(root))
    dims = ParallelDims(1, 2, 2)  # the two ranks of a cp group read the same samples
    dataset = build_online_dataset(
        config.data.inputs, config.encoding, config.caption_length, dims, torch.device("cpu"), dump
    )
    torch.save({"keys": dataset.keys, "data_rank": dims.data_rank}, out / f"rank{rank}.pt")


@pytest.mark.slow
def test_online_decode_check_at_cp_2_gathers_over_the_data_mesh(material, tmp_path):
    """At cp = 2 the data ranks are half the ranks: the decode check's failures gather over the data mesh
    (over the default group it would expect one part per rank), and every rank leaves out the same images."""
    run_distributed(_build_with_cp, 4, material, tmp_path / "dump", tmp_path)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert sorted(r["data_rank"] for r in results) == [0, 0, 1, 1]
    assert all(r["keys"] == results[0]["keys"] for r in results) and len(results[0]["keys"]) == 12
    report = [json.loads(line) for line in (tmp_path / "dump" / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS


ONLINE_XY = ["--data.mode=online", '--data.inputs=["x"]', "--encoding.vae=none"]


def test_online_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.inputs must list"):
        load_config(None, ["--data.mode=online", "--encoding.vae=none"])
    with pytest.raises(ConfigError, match="encoding.vae must name"):
        load_config(None, ["--data.mode=online", '--data.inputs=["x"]'])
    with pytest.raises(ConfigError, match="encoding.buckets: unknown aspect-ratio table 'ASPECT_RATIO_5'"):
        load_config(None, [*ONLINE_XY, "--encoding.buckets=ASPECT_RATIO_5"])
    with pytest.raises(ConfigError, match="encoding.caption_proportion must map"):
        load_config(None, ["--encoding.caption_proportion={prompt=0}"])
    config = load_config(None, ['--encoding.caption_proportion={prompt=1,"VILA1-5 13B"=2}'])
    (tmp_path / "resolved.toml").write_text(config.to_toml())  # a caption proportion survives the round trip
    assert load_config(tmp_path / "resolved.toml").encoding.caption_proportion == {"prompt": 1, "VILA1-5 13B": 2}
    # a key of [data] that moved to [encoding] says where it went
    with pytest.raises(ConfigError, match=r"data.vae is now encoding.vae \(the \[encoding\] section\)"):
        load_config(None, ["--data.vae=none"])
    # dtypes take any of their spellings
    spelled = load_config(None, ["--encoding.dtype=bf16", "--training.mixed_precision_param=fp32"])
    assert (spelled.encoding.dtype, spelled.training.mixed_precision_param) == ("bfloat16", "float32")


# ---------------------------------------------------------------------------------------------
# Training


def _train(rank, world_size, dump, out_file, *overrides):
    """STEPS steps, then one validation run whose logged images are recorded."""
    from sana2.train import Trainer

    validation = ["--validation.enable=true", "--validation.at_start=false", "--validation.sampling_steps=2"]
    trainer = Trainer(tiny_config(dump, *MODEL, *validation, "--validation.images_per_prompt=1", *overrides))
    losses = run_steps(trainer, STEPS)
    logged = []
    trainer.validator.metrics.images = lambda tag, images, step, nrow: logged.append(images)
    validation_loss = trainer.validator.run(STEPS).get("validation/loss")
    state = full_model_state(trainer.model)
    if rank == 0:
        result = {"losses": losses, "state": state, "validation_loss": validation_loss}
        result.update(samples=trainer.validator.last_images, logged=logged[0])
        torch.save(result, out_file)


@pytest.mark.slow
def test_online_training_on_2_ranks_equals_precomputed_training_on_1(material, tmp_path):
    val = f"--data.val_path={material / 'prepared'}"
    run_distributed(_train, 1, tmp_path / "pre", tmp_path / "pre.pt", f"--data.path={material / 'prepared'}", val)
    run_distributed(_train, 2, tmp_path / "online", tmp_path / "online.pt", *online_overrides(material), val)
    precomputed, online_run = torch.load(tmp_path / "pre.pt"), torch.load(tmp_path / "online.pt")
    # the same samples, batches, features (to the VAE's rounding) and noise: the same steps
    torch.testing.assert_close(
        torch.tensor(online_run["losses"]), torch.tensor(precomputed["losses"]), atol=1e-5, rtol=0
    )
    assert precomputed["state"].keys() == online_run["state"].keys()
    for key, value in precomputed["state"].items():
        torch.testing.assert_close(online_run["state"][key], value, atol=1e-5, rtol=0, msg=key)
    # the model's null caption is the text encoder's empty prompt, in both runs
    null = build_text_encoder("tiny-t5", 16).null_caption()[0]
    assert torch.equal(precomputed["state"]["y_embedder.y_embedding"], null)
    assert torch.equal(online_run["state"]["y_embedder.y_embedding"], null)
    # validation samples at the largest bucket's shape; online, they are decoded to RGB before logging
    assert precomputed["samples"].shape[1:] == online_run["samples"].shape[1:] == (4, 15, 16)
    assert precomputed["logged"].shape[1] == 1  # no VAE: the first latent channel
    from sana2.encoders.autoencoder import build_autoencoder

    decoded = build_autoencoder(material / "vae").decode(online_run["samples"])
    assert online_run["logged"].shape == (4, 3, 120, 128)
    assert torch.equal(online_run["logged"], decoded)
    assert precomputed["validation_loss"] > 0 and online_run["validation_loss"] > 0  # bucketed held-out loss


def _stop_and_resume(rank, world_size, dump, out_file, stop_at, *overrides):
    """Train to `stop_at` and save; or, with stop_at None, resume and train to 2 * STEPS."""
    from sana2 import train

    if stop_at is None:  # a resumed model's null caption must come from its checkpoint
        train.store_null_caption = lambda *args: pytest.fail("null caption stored on resume")
    checkpointing = ["--checkpoint.enable=true", "--checkpoint.interval=1000"]
    trainer = train.Trainer(tiny_config(dump, *MODEL, *checkpointing, *overrides))
    if stop_at is not None:
        losses = run_steps(trainer, stop_at)
        trainer.save_checkpoint(final=True)
    else:
        losses = run_steps(trainer, 2 * STEPS - trainer.step)
    state = full_model_state(trainer.model)
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out_file)


@pytest.mark.slow
def test_bucketed_training_resumes_exactly_at_another_world_size(material, tmp_path):
    data = f"--data.path={material / 'prepared'}"
    # 8 steps are 4 epochs: at G = 4 the buckets of 4, 5 and 3 samples give 2 steps per epoch
    run_distributed(_stop_and_resume, 1, tmp_path / "straight", tmp_path / "straight.pt", 2 * STEPS, data)
    run_distributed(_stop_and_resume, 2, tmp_path / "split", tmp_path / "first.pt", STEPS - 1, data)
    run_distributed(_stop_and_resume, 1, tmp_path / "split", tmp_path / "second.pt", None, data)
    straight, first, second = (torch.load(tmp_path / f"{name}.pt") for name in ("straight", "first", "second"))
    torch.testing.assert_close(
        torch.tensor(first["losses"] + second["losses"]), torch.tensor(straight["losses"]), atol=1e-5, rtol=0
    )
    for key, value in straight["state"].items():
        torch.testing.assert_close(second["state"][key], value, atol=1e-5, rtol=0, msg=key)
    # the resumed model's null caption came from the checkpoint (storing it again fails the run above)
    null = FeatureDataset(material / "prepared").null_caption()[0]
    assert torch.equal(second["state"]["y_embedder.y_embedding"], null)


# ---------------------------------------------------------------------------------------------
# An image that goes bad after the start-up check


def copied_inputs(material: Path, root: Path) -> list[str]:
    """The material's images copied to `root` (to damage them), read with its VAE and buckets."""
    shutil.copytree(material / "images", root / "images")
    return [*online_overrides(material), f'--data.inputs=["{root / "images"}"]']


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header still reads: the plan and its fingerprint stay


TRUNCATED = "corrupt or truncated image (image file is truncated)"


def test_an_image_that_goes_bad_in_training_gives_its_slot_to_the_next_of_its_bucket(material, tmp_path, sana2_log):
    config = load_config(None, copied_inputs(material, tmp_path))
    online_args = (config.data.inputs, config.encoding, config.caption_length)
    dump = tmp_path / "dump"
    dataset = build_online_dataset(*online_args, ParallelDims(1, 1), torch.device("cpu"), dump)
    wide = torch.nonzero(dataset.bucket_ids == 0).flatten().tolist()  # bucket "0.5": the 4 wide images
    bad, following, other = wide[0], wide[1], wide[2]
    expected = dataset.get_batch([following, other])
    truncate(Path(dataset.samples[bad].sample.image.path))  # after the start-up check
    got = dataset.get_batch([bad, other])
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    entry = {"source": dataset.samples[bad].sample.image.describe(), "reason": TRUNCATED, "found": "in training"}
    assert [json.loads(line) for line in (dump / "skipped.jsonl").read_text().splitlines()][-1] == entry
    assert f"{entry['source']}: {TRUNCATED}; it decoded when training started: skipped" in sana2_log.text
    assert f"1 inputs skipped in training so far, listed in {dump / 'skipped.jsonl'}" in sana2_log.text
    # at 2 data ranks each takes one slot of this batch: the same replacement (it follows from the index alone)
    per_rank = [dataset.get_batch([bad]), dataset.get_batch([other])]
    for name in expected:  # to the VAE's rounding over another batch composition
        torch.testing.assert_close(torch.cat([b[name] for b in per_rank]), expected[name], atol=1e-5, rtol=0)
    dataset.get_batch([other, bad])  # again (another epoch): reported once
    # a resubmission reuses the start-up check: the same sample set, the same decision, the report kept
    again = build_online_dataset(*online_args, ParallelDims(1, 1), torch.device("cpu"), dump)
    assert again.keys == dataset.keys
    got_again = again.get_batch([bad, other])
    assert all(torch.equal(got_again[name], expected[name]) for name in expected)
    report = [json.loads(line) for line in (dump / "skipped.jsonl").read_text().splitlines()]
    assert report.count(entry) == 1 and len(report) == len(EXPECTED_SKIPS) + 1
    # a whole bucket gone bad: one message naming the bucket, not an endless search
    for index in wide:
        truncate(Path(dataset.samples[index].sample.image.path))
    with pytest.raises(DataFormatError, match="no sample of bucket 0.5 decodes any more"):
        dataset.get_batch([other])


def _train_with_a_file_going_bad(argv: list[str], image: Path, monkeypatch) -> tuple[int, str]:
    """Train in this process; `image` is truncated at the first batch, after the start-up check passed it."""
    from sana2.train import main

    original = online.OnlineDataset.get_batch

    def damaging(self, indices):
        if image.stat().st_size > 0 and not getattr(damaging, "done", False):
            damaging.done = True
            truncate(image)
        return original(self, indices)

    monkeypatch.setattr(online.OnlineDataset, "get_batch", damaging)
    return main(argv)


@pytest.mark.slow
def test_training_goes_on_past_an_image_gone_bad_and_a_rerun_takes_the_same_steps(material, tmp_path, capfd):
    losses = []
    for run in ("first", "second"):
        overrides = copied_inputs(material, tmp_path / run)
        image = tmp_path / run / "images" / "wide0.png"  # in the one batch of bucket "0.5" every epoch
        argv = [*TINY, f"--job.dump_folder={tmp_path / run / 'dump'}", *MODEL, *overrides]
        argv += ["--training.steps=4", "--metrics.log_freq=1"]
        with pytest.MonkeyPatch.context() as patch:
            assert _train_with_a_file_going_bad(argv, image, patch) == 0
        err = capfd.readouterr().err
        assert f"{image}: {TRUNCATED}; it decoded when training started: skipped" in err
        assert "step 4/4" in err
        report = (tmp_path / run / "dump" / "skipped.jsonl").read_text()
        assert json.dumps({"source": str(image), "reason": TRUNCATED, "found": "in training"}) in report
        losses.append(re.findall(r"step \d/4  loss (\S+)", err))
    assert len(losses[0]) == 4 and losses[0] == losses[1]
