"""`sana2-prepare`: inputs -> buckets -> encoders -> version-2 shards; skips reported; resumable; torchrun."""

import dataclasses
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from dist_utils import run_command, run_distributed, torchrun_command
from encoder_factory import image_bytes, save_tiny_dc_ae, save_tiny_gemma2, save_tiny_kl
from safetensors.torch import load_file, save_file
from shard_damage import overwrite_tensor_bytes

from sana2.config import Encoding
from sana2.data.buckets import bucket_table, nearest_bucket
from sana2.data.features import DataFormatError, FeatureDataset, read_shard_info
from sana2.data.image import decode_rgb, resize_and_crop
from sana2.distributed.initialize import init_weights
from sana2.encoders.autoencoder import build_autoencoder
from sana2.encoders.text_encoder import build_text_encoder, store_null_caption
from sana2.models.registry import build_model
from sana2.prepare import PrepareOptions, main, parse_args, prepare

TESTS = Path(__file__).parent
REPO = TESTS.parent
# (width, height) of the good images: buckets "1.0" x2, "0.5", "2.0", "0.82" of ASPECT_RATIO_128
GOOD = {"square": (128, 128), "square2": (90, 90), "wide": (192, 96), "tall": (96, 192), "photo": (120, 100)}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return save_tiny_dc_ae(root / "vae"), save_tiny_gemma2(root / "gemma")


def make_folder(root: Path) -> Path:
    """Five good images with captions, and one of each kind of bad input."""
    root.mkdir(parents=True)
    for seed, (name, (width, height)) in enumerate(GOOD.items()):
        (root / f"{name}.png").write_bytes(image_bytes(width, height, seed))
        (root / f"{name}.txt").write_text(f"a picture called {name}")
    truncated = image_bytes(64, 64, 9)
    (root / "truncated.png").write_bytes(truncated[: len(truncated) // 2])
    (root / "truncated.txt").write_text("cut short")
    (root / "garbage.jpg").write_bytes(b"\x00not an image at all")
    (root / "garbage.txt").write_text("garbage")
    (root / "uncaptioned.png").write_bytes(image_bytes(64, 64))
    (root / "blank.png").write_bytes(image_bytes(64, 64))
    (root / "blank.txt").write_text("   \n")
    (root / "tiny.png").write_bytes(image_bytes(20, 20))
    (root / "tiny.txt").write_text("too small")
    return root


EXPECTED_SKIPS = {
    "truncated.png": "corrupt or truncated image (image file is truncated)",
    "garbage.jpg": "not an image file PIL can read",
    "uncaptioned.png": "no caption (looked for: prompt)",
    "blank.png": "empty caption ('prompt')",
    "tiny.png": "smaller than the minimum size 32 (20x20)",
}


def options(inputs, output, encoders, **overrides) -> PrepareOptions:
    """`overrides` of Encoding's fields go to the encoding section, the others are prepare's own."""
    vae, gemma = encoders
    encoding = dict(
        buckets="ASPECT_RATIO_128",
        vae=str(vae),
        text_encoder=str(gemma),
        instruction="Describe: ",
        min_size=32,
        workers=0,
    )
    settings = dict(
        inputs=[str(p) for p in inputs],
        output=str(output),
        max_length=16,
        batch_size=2,
        shard_size=2,
        feature_dtype="float32",
    )
    for key, value in overrides.items():
        (encoding if key in Encoding.__dataclass_fields__ else settings)[key] = value
    return PrepareOptions(**settings, encoding=Encoding(**encoding))


def shard_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted(folder.glob("shard_*.safetensors"))}


def test_prepare_encodes_each_image_in_its_bucket_and_reports_every_skip(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    summary = prepare(options([folder], tmp_path / "out", encoders))
    assert summary.encoded == 5 and summary.skipped == 5
    assert summary.per_bucket == {"0.5": 1, "0.82": 1, "1.0": 2, "2.0": 1}
    assert summary.skipped_by_reason == {
        "corrupt or truncated image": 1,
        "not an image file PIL can read": 1,
        "no caption": 1,
        "empty caption": 1,
        "smaller than the minimum size 32": 1,
    }
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS
    assert all(Path(r["source"]).parent == folder for r in report)  # full paths

    dataset = FeatureDataset(tmp_path / "out")
    vae, gemma = encoders
    vae, text = build_autoencoder(vae), build_text_encoder(str(gemma), 16, instruction="Describe: ")
    table = bucket_table("ASPECT_RATIO_128")
    for index, key in enumerate(dataset.keys):
        width, height = GOOD[key]
        bucket = table[nearest_bucket(height, width, table)]
        assert dataset.buckets[int(dataset.bucket_ids[index])]["name"] == bucket.name
        assert dataset.latent_shape_of(index) == (4, bucket.height // 2, bucket.width // 2)
        batch = dataset.get_batch([index])
        image = decode_rgb((folder / f"{key}.png").read_bytes())
        expected = vae.encode(resize_and_crop(image, bucket.height, bucket.width)[None])
        torch.testing.assert_close(batch["latents"], expected, atol=1e-5, rtol=1e-5)
        embeds, mask = text.encode([f"a picture called {key}"])
        torch.testing.assert_close(batch["caption_embeds"][:, 0], embeds, atol=1e-5, rtol=1e-5)
        assert torch.equal(batch["caption_mask"], mask.float())
    null_embeds, null_mask = dataset.null_caption()
    expected_null = text.null_caption()
    torch.testing.assert_close(null_embeds, expected_null[0]) and torch.equal(null_mask, expected_null[1])
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["metadata"]["text_encoder"] == {"instruction": "Describe: ", "max_length": 16}
    # every shard carries its tensors' CRC32: bytes damaged later are named at their first read
    shard = meta["shards"][-1]
    overwrite_tensor_bytes(tmp_path / "out" / shard["file"], "latents", size=64)
    last = len(dataset) - 1
    with pytest.raises(DataFormatError, match=f"{shard['file']}: tensor 'latents' is corrupt"):
        FeatureDataset(tmp_path / "out").get_batch([last])


@pytest.mark.parametrize("use_pe", [False, True])
def test_the_dit_takes_a_batch_of_every_bucket_at_its_own_shape(tmp_path, encoders, use_pe):
    prepare(options([make_folder(tmp_path / "images")], tmp_path / "out", encoders))
    dataset = FeatureDataset(tmp_path / "out")
    model = build_model("SanaMS_debug", caption_channels=32, model_max_length=16, use_pe=use_pe).eval()
    init_weights(model, 0)
    store_null_caption(model, dataset.null_caption()[0])
    for bucket in range(len(dataset.buckets)):
        indices = torch.nonzero(dataset.bucket_ids == bucket).flatten().tolist()
        batch = dataset.get_batch(indices)
        timesteps = torch.full((len(indices),), 300)
        with torch.no_grad():
            out = model(batch["latents"], timesteps, batch["caption_embeds"], batch["caption_mask"])
        assert out.shape == batch["latents"].shape and torch.isfinite(out).all()


def interrupt_after(count: int):
    written = []

    def hook(shard_index: int) -> None:
        written.append(shard_index)
        if len(written) == count:
            raise KeyboardInterrupt

    return hook


def test_an_interrupted_run_resumes_without_redoing_finished_shards(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    prepare(options([folder], tmp_path / "reference", encoders))
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(options([folder], out, encoders), on_shard_written=interrupt_after(2))
    assert not (out / "meta.json").exists()  # not a dataset yet
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("shard_*.safetensors")}
    assert len(finished) == 2
    summary = prepare(options([folder], out, encoders))
    # 5 planned shards: the truncated image is alone in the second "1.0" shard, which ends up empty
    assert (summary.shards_reused, summary.shards_written, summary.encoded) == (2, 2, 5)  # the empty one is not
    for name, identity in finished.items():
        assert ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) == identity  # untouched
    expected, got = shard_tensors(tmp_path / "reference"), shard_tensors(out)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n][k], got[n][k]) for n in expected for k in expected[n])
    for name in expected:  # keys, captions, skips and CRC32s alike (safetensors orders metadata at random)
        assert read_shard_info(out / name).metadata == read_shard_info(tmp_path / "reference" / name).metadata
    assert (out / "skipped.jsonl").read_text() == (tmp_path / "reference" / "skipped.jsonl").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_a_complete_output_is_kept_and_another_runs_output_is_refused(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    prepare(options([folder], tmp_path / "out", encoders))
    meta_time = (tmp_path / "out" / "meta.json").stat().st_mtime_ns
    again = prepare(options([folder], tmp_path / "out", encoders))
    assert (again.shards_written, again.shards_reused, again.encoded) == (0, 4, 5)
    assert (tmp_path / "out" / "meta.json").stat().st_mtime_ns == meta_time
    (folder / "new.png").write_bytes(image_bytes(64, 64))
    (folder / "new.txt").write_text("a new picture")
    with pytest.raises(ValueError, match="holds a dataset prepared from other inputs or settings"):
        prepare(options([folder], tmp_path / "out", encoders))
    with pytest.raises(ValueError, match="holds a dataset prepared from other inputs or settings"):
        prepare(options([folder], tmp_path / "out", encoders, seed=1))
    assert prepare(options([folder], tmp_path / "out", encoders, overwrite=True)).encoded == 6
    (tmp_path / "out" / "README.md").write_text("my dataset card")  # the user's, in the output since
    with pytest.raises(ValueError, match=r"out: it holds what sana2-prepare did not write \(README\.md\)"):
        prepare(options([folder], tmp_path / "out", encoders, seed=2, overwrite=True))
    assert (tmp_path / "out" / "README.md").read_text() == "my dataset card"
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(ValueError, match="unrelated: it is not an earlier sana2-prepare output"):
            prepare(options([folder], tmp_path / "unrelated", encoders, overwrite=overwrite))
    assert (tmp_path / "unrelated" / "notes.txt").read_text() == "mine"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
@pytest.mark.parametrize(
    "output, message",
    [
        ("data/images", "refusing to write {data}/images: it is one of this command's inputs"),
        ("data", "refusing to write {data}: it contains the input {data}/images"),
        ("data/images/features", "refusing to write {data}/images/features: it lies inside the input {data}/images"),
        ("data/listed", "refusing to write {data}/listed: it contains the input {data}/listed/more"),
        ("vae", "refusing to write {root}/vae: it is one of this command's inputs"),
    ],
)
def test_an_output_overlapping_an_input_is_refused_and_nothing_is_deleted(
    tmp_path, encoders, capsys, overwrite, output, message
):
    """--output the input folder, a folder containing it or inside it, a folder holding images that a
    manifest lists, or an encoder's folder: exit 2 naming both, with or without --overwrite, all inputs kept."""
    data = tmp_path / "data"
    folder = make_folder(data / "images")
    (data / "listed" / "more").mkdir(parents=True)
    (data / "listed" / "more" / "one.png").write_bytes(image_bytes(64, 64, 3))
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps({"path": str(data / "listed" / "more" / "one.png"), "caption": "one"}) + "\n")
    vae, gemma = encoders
    root = vae.parent
    out = root / "vae" if output == "vae" else tmp_path / output
    before = _tree(tmp_path), _tree(root)
    args = cli_args(folder, out, encoders)
    assert main([str(manifest), *args, *overwrite]) == 2
    error = capsys.readouterr().err
    assert message.format(data=data, root=root) in error and error.count("\n") == 1, error
    assert (_tree(tmp_path), _tree(root)) == before


def test_kl_posterior_samples_are_seeded_per_sample(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    kl = save_tiny_kl(tmp_path / "kl")
    runs = {
        name: shard_tensors(tmp_path / name)
        for name, overrides in {
            "sample": dict(posterior="sample"),
            "again": dict(posterior="sample"),
            "seed1": dict(posterior="sample", seed=1),
            "mode": dict(),
        }.items()
        if prepare(options([folder], tmp_path / name, (kl, encoders[1]), **overrides))
    }
    same = lambda a, b: all(torch.equal(runs[a][n]["latents"], runs[b][n]["latents"]) for n in runs[a])  # noqa: E731
    assert same("sample", "again") and not same("sample", "seed1") and not same("sample", "mode")


def make_tar_and_manifest(root: Path) -> tuple[Path, Path]:
    root.mkdir(parents=True)
    with tarfile.open(root / "00000.tar", "w") as archive:
        for key, (width, height) in {"t0": (64, 64), "t1": (40, 80)}.items():
            for extension, data in (
                ("png", image_bytes(width, height)),
                ("json", json.dumps({"prompt": f"tar {key}", "width": width, "height": height}).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    (root / "m0.png").write_bytes(image_bytes(80, 40, 3))
    manifest = root / "list.jsonl"
    manifest.write_text(json.dumps({"path": "m0.png", "captions": {"prompt": "manifest m0"}}) + "\n")
    return root / "00000.tar", manifest


def test_tar_shards_and_manifests_in_pixel_space(tmp_path):
    shard, manifest = make_tar_and_manifest(tmp_path / "inputs")
    run = PrepareOptions(
        inputs=[str(shard), str(manifest)],
        output=str(tmp_path / "out"),
        encoding=Encoding(buckets="ASPECT_RATIO_128", vae="none", workers=1),  # decoding in a worker process
        max_length=8,
        feature_dtype="float32",
    )
    summary = prepare(run)
    assert summary.encoded == 3 and summary.per_bucket == {"0.5": 1, "1.0": 1, "2.0": 1}
    dataset = FeatureDataset(tmp_path / "out")
    assert sorted(dataset.keys) == ["0:00000.tar/t0", "0:00000.tar/t1", "1:m0.png"]
    assert sorted(dataset.captions) == ["manifest m0", "tar t0", "tar t1"]
    index = dataset.keys.index("1:m0.png")
    pixels = resize_and_crop(decode_rgb(image_bytes(80, 40, 3)), 88, 176)  # bucket "0.5" of the 128 table
    assert torch.equal(dataset.get_batch([index])["latents"][0], pixels)


def test_command_line_options_and_errors(tmp_path, capsys):
    parsed = parse_args(
        ["in", "--output", "o", "--buckets", "256x512", "--vae", "none", "--text-encoder", "tiny-t5"]
        + ["--caption-proportion", "prompt=1,InternVL2-26B=2.5", "--caption-suffixes", ",_InternVL2-26B"]
    )
    encoding = parsed.encoding
    assert encoding.caption_proportion == {"prompt": 1.0, "InternVL2-26B": 2.5}
    assert encoding.caption_suffixes == ["", "_InternVL2-26B"] and parsed.max_length == 300
    # the encoders' dtype is the one online mode defaults to (float32), the stored features bfloat16
    assert (encoding.dtype, parsed.feature_dtype, encoding.instruction) == ("float32", "bfloat16", "auto")
    assert encoding == dataclasses.replace(
        Encoding(), buckets="256x512", vae="none", caption_proportion=encoding.caption_proportion,
        caption_suffixes=encoding.caption_suffixes,
    )  # fmt: skip
    # a training config's [encoding] and caption length are the defaults; flags override them; dtypes take aliases
    config = tmp_path / "train.toml"
    config.write_text('[model]\nmodel_max_length = 24\n[encoding]\nvae = "none"\nbuckets = "64x64"\nseed = 5\n')
    parsed = parse_args(["in", "--output", "o", "--config", str(config), "--seed", "6", "--model-dtype", "bf16"])
    assert (parsed.encoding.vae, parsed.encoding.buckets, parsed.encoding.seed) == ("none", "64x64", 6)
    assert (parsed.max_length, parsed.encoding.dtype) == (24, "bfloat16")
    with pytest.raises(SystemExit):
        parse_args(["in", "--output", "o"])
    assert "--vae (or the config's encoding.vae) must name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["in", "--output", "o", "--vae", "none", "--buckets", "ASPECT_RATIO_5"])
    assert "encoding.buckets: unknown aspect-ratio table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(
            ["in", "--output", "o", "--buckets", "x", "--vae", "none", "--text-encoder", "t"]
            + ["--caption-proportion", "prompt"]
        )
    assert "expected TYPE=WEIGHT items" in capsys.readouterr().err
    code = main(
        [str(tmp_path / "nothing"), "--output", str(tmp_path / "o"), "--buckets", "ASPECT_RATIO_128"]
        + ["--vae", "none", "--text-encoder", "tiny-t5"]
    )
    assert code == 2 and "nothing: expected an image folder" in capsys.readouterr().err


def test_a_text_encoder_without_tokenizer_is_refused_before_any_shard(tmp_path, encoders, capsys):
    """A pipeline's text_encoder/ copied alone would give every caption the same embedding."""
    vae, gemma = encoders
    bare = tmp_path / "gemma-without-tokenizer"
    shutil.copytree(gemma, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    folder, output = make_folder(tmp_path / "images"), tmp_path / "out"
    code = main(cli_args(folder, output, (vae, bare)))
    assert code == 2
    assert f"text encoder {bare}: no tokenizer files" in capsys.readouterr().err
    assert not list(output.glob("shard_*"))


def cli_args(folder: Path, output: Path, encoders) -> list[str]:
    vae, gemma = encoders
    return [str(folder), "--output", str(output), "--buckets", "ASPECT_RATIO_128", "--vae", str(vae)] + [
        "--text-encoder", str(gemma), "--max-length", "16", "--instruction", "Describe: ", "--min-size", "32",
        "--batch-size", "2", "--shard-size", "2", "--workers", "0",
    ]  # fmt: skip


def run_cli(args: list[str], env_extra: dict | None = None, torchrun: int = 0) -> subprocess.CompletedProcess:
    prepare = ["-m", "sana2.prepare", *args]
    return run_command(torchrun_command(torchrun, *prepare) if torchrun else [sys.executable, *prepare], env_extra)


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_finished_shards(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    reference = run_cli(cli_args(folder, tmp_path / "reference", encoders))
    assert reference.returncode == 0, reference.stderr
    assert "encoded 5 samples" in reference.stdout and "skipped 5 inputs" in reference.stdout
    killer = [sys.executable, str(TESTS / "prepare_killer.py"), *cli_args(folder, tmp_path / "out", encoders)]
    killed = run_command(killer, {"KILL_AFTER": "1"})
    assert killed.returncode == -9
    finished = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("shard_*.safetensors")}
    assert len(finished) == 1 and not (tmp_path / "out" / "meta.json").exists()
    resumed = run_cli(cli_args(folder, tmp_path / "out", encoders))
    assert resumed.returncode == 0, resumed.stderr
    assert "3 shards written, 1 kept from an earlier run" in resumed.stdout  # 4 shards in all
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in finished} == finished
    expected, got = shard_tensors(tmp_path / "reference"), shard_tensors(tmp_path / "out")
    assert all(torch.equal(expected[n][k], got[n][k]) for n in expected for k in expected[n])


@pytest.mark.slow
def test_torchrun_ranks_share_the_work_with_a_sharded_text_encoder(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    one = prepare(options([folder], tmp_path / "one", encoders, dtype="bfloat16", feature_dtype="bfloat16"))
    args = cli_args(folder, tmp_path / "two", encoders) + ["--shard-text-encoder"]
    two = run_cli(args + ["--model-dtype", "bfloat16", "--feature-dtype", "bfloat16", "--device", "cpu"], torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "encoded 5 samples" in two.stdout and two.stdout.count("encoded 5 samples") == 1  # rank 0 reports
    expected, got = shard_tensors(tmp_path / "one"), shard_tensors(tmp_path / "two")
    assert expected.keys() == got.keys() and one.encoded == 5
    assert all(torch.equal(expected[n][k], got[n][k]) for n in expected for k in expected[n])
    assert load_file(tmp_path / "one" / "null_caption.safetensors")["caption_embeds"].equal(
        load_file(tmp_path / "two" / "null_caption.safetensors")["caption_embeds"]
    )


def test_every_file_of_a_prepared_dataset_has_the_umasks_permissions(tmp_path, encoders):
    """Another account of the group reads the dataset: shards and null caption are not left 0600."""
    folder = make_folder(tmp_path / "images")
    previous = os.umask(0o027)
    try:
        prepare(options([folder], tmp_path / "out", encoders))
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "out", *(tmp_path / "out").iterdir()]}
    assert "null_caption.safetensors" in modes and "shard_00000.safetensors" in modes
    assert modes == {name: 0o750 if name == "out" else 0o640 for name in modes}


def test_a_disk_filling_while_a_shard_is_written_is_named_and_the_finished_shards_stay(
    tmp_path, encoders, monkeypatch, capsys
):
    """The safetensors writer reports ENOSPC in its own exception: exit 2 with "no space left on", no traceback."""
    from safetensors import SafetensorError

    from sana2.data import writer

    written = []

    def save_until_full(tensors, path, metadata=None):
        if len(written) == 2:
            Path(path).write_bytes(b"\0" * 100)  # a partial file, as the full disk leaves it
            # the text the safetensors writer gives (it keeps the errno only in its message)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        written.append(path)
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", save_until_full)
    folder = make_folder(tmp_path / "images")
    out = tmp_path / "out"
    assert main(cli_args(folder, out, encoders)) == 2
    err = capsys.readouterr().err  # after the encoders' loading bars: one line
    last = err.splitlines()[-1]
    assert last.startswith(f"sana2-prepare: error: no space left on {out}/shard_00001.safetensors: needs about ")
    assert last.endswith(" free") and "Traceback" not in err and "SafetensorError" not in err
    assert len(list(out.glob("shard_*.safetensors"))) == 1 and not [p for p in out.iterdir() if p.name[0] == "."]


def test_a_prepare_with_no_decodable_image_writes_its_skip_report_and_a_corrected_retry_runs(
    tmp_path, encoders, capsys
):
    """The error names skipped.jsonl, which exists; the leftover (plan file, report) does not block the
    corrected run into the same --output, without --overwrite."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for seed, name in enumerate("ab"):
        whole = image_bytes(64, 64, seed)
        (broken / f"{name}.png").write_bytes(whole[: len(whole) // 2])  # planned, then fails to decode
        (broken / f"{name}.txt").write_text("a caption")
    out = tmp_path / "out"
    assert main(cli_args(broken, out, encoders)) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert (
        f"no sample could be encoded: all 2 inputs were skipped, listed with their reasons in {out}/skipped.jsonl"
        in (error)
    )
    assert len((out / "skipped.jsonl").read_text().splitlines()) == 2
    folder = make_folder(tmp_path / "images")
    assert main(cli_args(folder, out, encoders)) == 0
    assert len(FeatureDataset(out)) == 5


def test_the_summary_counts_only_shards_with_samples_and_the_rate_of_what_this_run_encoded(tmp_path, encoders):
    folder = make_folder(tmp_path / "images")
    # 5 planned shards: the truncated image is alone in the second "1.0" shard, which ends up empty
    first = prepare(options([folder], tmp_path / "out", encoders))
    assert (first.shards_written, first.shards_reused, first.encoded_now) == (4, 0, 5)
    assert len(list((tmp_path / "out").glob("shard_*.safetensors"))) == 4
    again = prepare(options([folder], tmp_path / "out", encoders))
    assert (again.shards_written, again.shards_reused, again.encoded, again.encoded_now) == (0, 4, 5, 0)
    assert "(0.00 images/s)" in again.lines(tmp_path / "out")[0]


def test_a_stop_signal_lets_the_write_in_progress_finish_exits_0_and_the_rerun_finishes_the_same_dataset(
    tmp_path, encoders, monkeypatch, capsys
):
    """SIGTERM (a scheduler's preemption) during the third shard's write: the handler only notes it, so that write
    finishes and the run stops before the next batch: exit 0, "stopped; rerun to resume", the three finished shards
    kept whole; the same command then encodes the rest, identical to a run never stopped."""
    import signal

    from sana2.data import writer

    folder = make_folder(tmp_path / "images")
    inputs = _tree(folder)
    reference = tmp_path / "reference"
    assert main(cli_args(folder, reference, encoders)) == 0
    saved = []

    def signalled_during_the_third_shard(tensors, path, metadata=None):
        saved.append(path)
        if len(saved) == 4:  # the null caption, then the shards
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this thread at the next bytecode
        return save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(writer, "save_file", signalled_during_the_third_shard)
    out = tmp_path / "out"
    previous = signal.getsignal(signal.SIGTERM)
    capsys.readouterr()
    assert main(cli_args(folder, out, encoders)) == 0
    assert signal.getsignal(signal.SIGTERM) is previous  # put back
    err = capsys.readouterr().err
    assert f"sana2-prepare: SIGTERM: stopped; rerun to resume (the finished shards in {out} are kept" in err
    assert "Traceback" not in err
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*.safetensors")}
    assert len(kept) == 3 and not (out / "meta.json").exists()
    assert Path(sorted(kept)[-1]).stem in Path(saved[3]).name  # the shard being written when the signal came
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no partial file
    monkeypatch.undo()
    assert main(cli_args(folder, out, encoders)) == 0
    assert "1 shards written, 3 kept from an earlier run" in capsys.readouterr().out
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
    expected, got = shard_tensors(reference), shard_tensors(out)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[n][k], got[n][k]) for n in expected for k in expected[n])
    assert (out / "skipped.jsonl").read_text() == (reference / "skipped.jsonl").read_text()
    assert _tree(folder) == inputs  # nothing of the user's was touched


def _stop_noted_on_rank_1_only(rank, world, folder, out, encoders):
    import signal

    from sana2.components.preemption import StopSignal
    from sana2.prepare import Stopped

    stop = StopSignal()  # not installed: the signal is noted by hand, on rank 1, after its first shard

    def noted(shard_index):
        if rank == 1:
            stop.signum = signal.SIGTERM

    try:
        prepare(options([folder], out, encoders, shard_size=1, batch_size=1), on_shard_written=noted, stop_signal=stop)
    except Stopped as exc:
        assert str(exc) == "SIGTERM"
    else:
        raise AssertionError(f"rank {rank} did not stop")


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_batch(tmp_path, encoders):
    """2 gloo ranks, the signal noted on rank 1 only, after its first shard: both ranks agree before the next batch,
    stop there with Stopped (no collective left waiting) and keep their finished shard: shards 0 and 1, no other."""
    folder = tmp_path / "images"
    folder.mkdir()
    for seed in range(8):  # one shard each: rank 0 encodes shards 0, 2, 4, 6; rank 1 shards 1, 3, 5, 7
        (folder / f"{seed:02d}.png").write_bytes(image_bytes(96, 96, seed))
        (folder / f"{seed:02d}.txt").write_text(f"picture {seed}")
    out = tmp_path / "out"
    run_distributed(_stop_noted_on_rank_1_only, 2, folder, out, encoders)
    assert sorted(p.name for p in out.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]
    assert not (out / "meta.json").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_with_exit_0_and_the_rerun_resumes(tmp_path, encoders):
    """`python -m sana2.launch --nproc_per_node 2 -m sana2.prepare ...` (torchrun's agent; plain torchrun exits 1
    with a traceback on SIGTERM, whatever its workers do): SIGTERM once the first shard is in stops both ranks (the
    text encoder sharded over them) with exit 0; the rerun gives the dataset of a run never stopped."""
    import signal
    import time

    folder = tmp_path / "images"
    folder.mkdir()
    for seed in range(24):  # one shard each: many shards still to do when the first is in
        (folder / f"{seed:02d}.png").write_bytes(image_bytes(96, 96, seed))
        (folder / f"{seed:02d}.txt").write_text(f"picture {seed}")
    dtypes = ["--model-dtype", "bfloat16", "--feature-dtype", "bfloat16", "--device", "cpu", "--shard-size", "1"]
    args = cli_args(folder, tmp_path / "out", encoders) + dtypes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "sana2.launch", "--nproc_per_node=2", "-m", "sana2.prepare", *args]
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "out").glob("shard_*.safetensors")) and launcher.poll() is None:
        assert time.monotonic() < deadline, "no shard written in 300 s"
        time.sleep(0.01)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    assert "SIGTERM: the workers stop now and keep the shards they finished" in err
    assert f"sana2-prepare: SIGTERM: stopped; rerun to resume (the finished shards in {tmp_path / 'out'}" in err
    assert "Traceback" not in err and "encoded" not in out  # stopped before the summary
    kept = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").glob("shard_*.safetensors")}
    assert 1 <= len(kept) < 24 and not (tmp_path / "out" / "meta.json").exists()
    assert main(cli_args(folder, tmp_path / "out", encoders) + dtypes) == 0  # the rerun, in this process
    assert {name: (tmp_path / "out" / name).stat().st_mtime_ns for name in kept} == kept
    assert main(cli_args(folder, tmp_path / "reference", encoders) + dtypes) == 0
    expected, got = shard_tensors(tmp_path / "reference"), shard_tensors(tmp_path / "out")
    assert len(expected) == 24 and expected.keys() == got.keys()
    assert all(torch.equal(expected[n][k], got[n][k]) for n in expected for k in expected[n])


def test_the_default_workers_never_outnumber_the_cores_and_the_loader_does_not_warn(
    tmp_path, encoders, monkeypatch, recwarn
):
    """2 decoding workers per rank where the cores allow; on one core (or 2 cores shared by 2 ranks) one."""
    import warnings

    from sana2.config import default_workers

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for cores, ranks, expected in ((16, 1, 2), (16, 8, 2), (2, 1, 2), (2, 2, 1), (1, 1, 1), (4, 8, 0)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        assert default_workers() == expected, (cores, ranks)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # a one-core machine, as the loader sees it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    args = cli_args(make_folder(tmp_path / "images"), tmp_path / "out", encoders)
    args = args[: args.index("--workers")] + args[args.index("--workers") + 2 :]  # the default
    assert parse_args(args).encoding.workers == 1
    warnings.simplefilter("always")
    assert main(args) == 0 and len(FeatureDataset(tmp_path / "out")) == 5
    assert not [w for w in recwarn if "worker" in str(w.message)], [str(w.message) for w in recwarn]


def test_an_encoder_folder_that_is_not_there_is_named_by_what_set_it_before_any_input_is_read(tmp_path, capsys):
    """The flag (or --config's key) and the folder, exit 2, before the inputs are listed or the output made."""
    folder = make_folder(tmp_path / "images")
    inputs, gone = _tree(folder), tmp_path / "models" / "gone"
    config = tmp_path / "train.toml"
    config.write_text(f'[encoding]\nvae = "{gone}"\n')
    base = [str(folder), "--output", str(tmp_path / "out"), "--buckets", "ASPECT_RATIO_128"]
    cases = [
        (["--vae", str(gone)], f"sana2-prepare: error: --vae: VAE '{gone}': no config.json there"),
        (
            ["--vae", "none", "--text-encoder", str(gone)],
            f"sana2-prepare: error: --text-encoder: text encoder '{gone}': no such directory (expected 'tiny-t5'",
        ),
        (["--config", str(config)], f"sana2-prepare: error: --config {config} (encoding.vae): VAE '{gone}': no"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit:
            main(base + args)
        assert exit.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and _tree(folder) == inputs
