"""Clips through sana2-prepare and online mode: [C, T, h, w] Wan latents per bucket, frames and fps recorded,
every bad clip skipped and reported, resumable, and online equal to precomputed."""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from dist_utils import free_port
from safetensors.torch import load_file
from shard_damage import overwrite_tensor_bytes
from video_factory import tiny_wan_vae, write_test_clip

from sana2.config import Encoding, load_config
from sana2.data.features import DataFormatError, FeatureDataset
from sana2.data.frame_window import FrameWindow
from sana2.data.online import build_online_dataset
from sana2.data.video_decode import load_clip
from sana2.distributed.parallel_dims import ParallelDims
from sana2.encoders.autoencoder import build_autoencoder
from sana2.encoders.text_encoder import build_text_encoder
from sana2.prepare import PrepareOptions, main, prepare

REPO = Path(__file__).resolve().parents[1]
BUCKETS = "32x48"  # one bucket: 9 frames of 32x48 -> Wan latents [4, 3, 4, 6]
EXPECTED_SKIPS = {
    "short.mp4": "too short: 6 frames at 16 fps give 6 frames at 16 fps, 9 needed",
    "silent.mp4": "no caption (looked for: prompt)",
    "broken.mp4": "not a video file FFmpeg can read",
    "orphan.txt": "caption file with no clip beside it",
}


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video")
    tiny_wan_vae(root / "vae")
    clips = root / "clips"
    for i, (frames, fps, width, height) in enumerate([(12, 16, 48, 32), (20, 30, 64, 40), (9, 16, 40, 32)]):
        write_test_clip(clips / f"clip{i}.mp4", frames=frames, fps=fps, width=width, height=height)
        (clips / f"clip{i}.txt").write_text(f"a grey clip number {i}")
    write_test_clip(clips / "short.mp4", frames=6, fps=16)
    (clips / "short.txt").write_text("too short")
    write_test_clip(clips / "silent.mp4", frames=12, fps=16)
    (clips / "broken.mp4").write_bytes(b"\x00" * 64)
    (clips / "broken.txt").write_text("broken")
    (clips / "orphan.txt").write_text("its clip is gone")
    return root


def options(root: Path, output: Path, **overrides) -> PrepareOptions:
    encoding = Encoding(buckets=BUCKETS, vae=str(root / "vae"), workers=0, num_frames=9, fps=16.0)
    settings = dict(inputs=[str(root / "clips")], output=str(output), max_length=16, feature_dtype="float32")
    settings.update(batch_size=2, shard_size=2)
    return PrepareOptions(**{**settings, **overrides}, encoding=encoding)


@pytest.mark.slow
def test_prepare_writes_wan_latents_of_clips_and_resumes(material, tmp_path):
    written = []
    summary = prepare(options(material, tmp_path / "out"), on_shard_written=written.append)
    assert summary.encoded == 3 and written == [0, 1]
    dataset = FeatureDataset(tmp_path / "out")
    assert dataset.latent_shapes == [(4, 3, 4, 6)] and sorted(dataset.keys) == ["clip0", "clip1", "clip2"]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["metadata"]["video"] == {"num_frames": 9, "fps": 16.0, "start": "first"}
    report = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS
    # the latents are the Wan VAE's of the clip's 9 frames at 16 fps, cropped to the bucket
    vae = build_autoencoder(material / "vae")
    index = dataset.keys.index("clip1")
    pixels = load_clip(material / "clips" / "clip1.mp4", FrameWindow(9, 16.0), 32, 48)
    torch.testing.assert_close(dataset.get_batch([index])["latents"], vae.encode(pixels[None]), atol=1e-5, rtol=0)
    embeds, mask = build_text_encoder("tiny-t5", 16).encode(["a grey clip number 1"])
    assert torch.equal(dataset.get_batch([index])["caption_embeds"][:, 0], embeds)
    # started again: nothing left to encode
    again = prepare(options(material, tmp_path / "out"), on_shard_written=written.append)
    assert again.encoded == 3 and written == [0, 1]
    # a clip's latents damaged on disk are named at their first read, with their shard
    shard = json.loads((tmp_path / "out" / "meta.json").read_text())["shards"][0]
    overwrite_tensor_bytes(tmp_path / "out" / shard["file"], "latents", size=64)
    with pytest.raises(DataFormatError, match=f"{shard['file']}: tensor 'latents' is corrupt"):
        FeatureDataset(tmp_path / "out").get_batch([0])


@pytest.mark.slow
def test_online_clips_are_the_precomputed_clips(material, tmp_path):
    prepare(options(material, tmp_path / "out"))
    prepared = FeatureDataset(tmp_path / "out")
    overrides = [
        "--data.mode=online",
        f'--data.inputs=["{material / "clips"}"]',
        f"--encoding.vae={material / 'vae'}",
        f"--encoding.buckets={BUCKETS}",
        "--encoding.workers=0",
        "--encoding.num_frames=9",
    ]
    config = load_config(None, overrides)
    args = (config.data.inputs, config.encoding, config.caption_length)
    dataset = build_online_dataset(*args, ParallelDims(1, 1), torch.device("cpu"), tmp_path / "dump")
    assert dataset.keys == prepared.keys and dataset.buckets == prepared.buckets
    got, expected = dataset.get_batch([0, 1, 2]), prepared.get_batch([0, 1, 2])
    torch.testing.assert_close(got["latents"], expected["latents"], atol=1e-5, rtol=0)
    assert torch.equal(got["caption_embeds"], expected["caption_embeds"])
    report = [json.loads(line) for line in (tmp_path / "dump" / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS


def test_prepare_command_line_checks_the_frame_window(material, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [str(material / "clips"), "--output", str(tmp_path / "o"), "--buckets", BUCKETS, "--vae", "none"]
            + ["--text-encoder", "tiny-t5", "--num-frames", "8"]
        )
    assert exit_info.value.code == 2 and "4k + 1" in capsys.readouterr().err


@pytest.mark.slow
def test_two_torchrun_ranks_prepare_the_features_one_rank_does(material, tmp_path):
    """Clips shared over 2 gloo ranks give one dataset: the same shards, latents and captions, and one skip report."""
    prepare(options(material, tmp_path / "one"))
    args = [str(material / "clips"), "--output", str(tmp_path / "two"), "--buckets", BUCKETS] + [
        "--vae", str(material / "vae"), "--text-encoder", "tiny-t5", "--max-length", "16", "--num-frames", "9",
        "--fps", "16", "--batch-size", "2", "--shard-size", "2", "--workers", "0", "--feature-dtype", "float32",
        "--device", "cpu",
    ]  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    two = subprocess.run(
        [*launch, "-m", "sana2.prepare", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("encoded 3 samples") == 1  # rank 0 reports for both
    one_shards = sorted(p.name for p in (tmp_path / "one").glob("shard_*.safetensors"))
    two_shards = sorted(p.name for p in (tmp_path / "two").glob("shard_*.safetensors"))
    assert one_shards == two_shards and len(one_shards) == 2
    for name in one_shards:
        expected, got = load_file(tmp_path / "one" / name), load_file(tmp_path / "two" / name)
        assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    one, two_ = FeatureDataset(tmp_path / "one"), FeatureDataset(tmp_path / "two")
    assert sorted(one.keys) == sorted(two_.keys) == ["clip0", "clip1", "clip2"]
    meta = json.loads((tmp_path / "two" / "meta.json").read_text())
    assert meta["metadata"]["video"] == {"num_frames": 9, "fps": 16.0, "start": "first"}
    report = [json.loads(line) for line in (tmp_path / "two" / "skipped.jsonl").read_text().splitlines()]
    assert {Path(r["source"]).name: r["reason"] for r in report} == EXPECTED_SKIPS
