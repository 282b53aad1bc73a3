"""Clips in: decoding at a target frame rate, the video buckets, the three video layouts and what they skip."""

import json
import zipfile

import numpy as np
import pytest
import torch
from video_factory import level, write_test_clip

from sana2.data.buckets import bucket_table, nearest_bucket
from sana2.data.dataset_plan import plan_dataset
from sana2.data.frame_window import BadVideo, FrameWindow
from sana2.data.sources import choose_caption, list_inputs
from sana2.data.video_decode import decode_frames, load_clip, probe, write_clip
from sana2.data.video_sources import Clip, is_video_input, list_clips


def _levels(frames) -> list[int]:
    return [int(np.median(np.asarray(frame))) for frame in frames]


def _near(decoded: list[int], indices: list[int]) -> bool:
    return all(abs(d - level(i)) <= 3 for d, i in zip(decoded, indices))


def test_resampling_picks_the_frame_on_screen_at_each_target_time(tmp_path):
    clip = write_test_clip(tmp_path / "a.mp4", frames=24, fps=30)
    info = probe(clip)
    assert (info.width, info.height, info.fps, info.frames) == (48, 32, 30.0, 24)
    frames, _ = decode_frames(clip, FrameWindow(num_frames=9, fps=16))
    # target frame i at i/16 s shows source frame floor(i * 30 / 16)
    assert _near(_levels(frames), [0, 1, 3, 5, 7, 9, 11, 13, 15])
    # the middle window of the 13 resampled frames starts at resampled frame 2
    frames, _ = decode_frames(clip, FrameWindow(num_frames=9, fps=16, start="center"))
    assert _near(_levels(frames), [3, 5, 7, 9, 11, 13, 15, 16, 18])
    # a clip slower than the target rate shows each frame twice
    slow = write_test_clip(tmp_path / "slow.mp4", frames=6, fps=8)
    frames, _ = decode_frames(slow, FrameWindow(num_frames=9, fps=16))
    assert _near(_levels(frames), [0, 0, 1, 1, 2, 2, 3, 3, 4])


def test_clip_is_resized_and_centre_cropped_to_its_bucket(tmp_path):
    clip = write_test_clip(tmp_path / "a.mp4", frames=5, fps=16, width=64, height=32)
    pixels = load_clip(clip, FrameWindow(num_frames=5, fps=16), 32, 32)
    assert pixels.shape == (3, 5, 32, 32) and pixels.dtype == torch.float32
    assert -1 <= pixels.min() and pixels.max() <= 1
    # the 16x8 bright corner of the 64x32 frame lies left of the centre crop (columns 16..48)
    assert pixels[:, 0, :4, :4].mean() < 0.5 * (pixels[:, 0, :8, :16].mean() + 1) + 1


def test_window_must_be_4k_plus_1_and_bad_clips_say_why(tmp_path):
    with pytest.raises(ValueError, match="4k"):
        FrameWindow(num_frames=8)
    short = write_test_clip(tmp_path / "short.mp4", frames=10, fps=30)
    with pytest.raises(BadVideo, match="too short: 10 frames at 30 fps give 5 frames at 16 fps, 9 needed"):
        decode_frames(short, FrameWindow(num_frames=9, fps=16))
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"this is not a video" * 50)
    with pytest.raises(BadVideo, match="not a video|unreadable"):
        probe(garbage)
    whole = write_test_clip(tmp_path / "whole.mkv", frames=40, fps=16, width=64, height=64)
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 3])
    with pytest.raises(BadVideo):
        decode_frames(cut, FrameWindow(num_frames=37, fps=16))


def test_write_clip_round_trips_frames(tmp_path):
    frames = torch.full((3, 5, 16, 24), -1.0)
    frames[:, 2] = 1.0
    path = write_clip(tmp_path / "out.mp4", frames, fps=16)
    info = probe(path)
    assert (info.width, info.height, info.fps, info.frames) == (24, 16, 16.0, 5)
    decoded = load_clip(path, FrameWindow(num_frames=5, fps=16), 16, 24)
    assert decoded[:, 2].mean() > 0.9 and decoded[:, 1].mean() < -0.9


def test_video_buckets_are_sana_videos():
    table = bucket_table("ASPECT_RATIO_VIDEO_480")
    assert len(table) == 11 and table[nearest_bucket(480, 832, table)].name == "0.57"
    assert all(b.height % 16 == 0 and b.width % 16 == 0 for b in table + bucket_table("ASPECT_RATIO_VIDEO_720"))
    pipeline = pytest.importorskip("diffusers.pipelines.sana_video.pipeline_sana_video")
    for name, theirs in (("480", pipeline.ASPECT_RATIO_480_BIN), ("720", pipeline.ASPECT_RATIO_720_BIN)):
        ours = {b.name: [float(b.height), float(b.width)] for b in bucket_table(f"ASPECT_RATIO_VIDEO_{name}")}
        assert ours == theirs


def _reasons(listing_or_plan) -> dict[str, str]:
    return {skip.source.split("/")[-1]: skip.reason for skip in listing_or_plan.skipped}


def test_clip_folder_reports_every_unusable_input(tmp_path):
    root = tmp_path / "clips"
    write_test_clip(root / "good.mp4", frames=12, fps=16)
    (root / "good.txt").write_text("a grey square\nthat fades\n")
    write_test_clip(root / "sub" / "meta.webm", frames=12, fps=16)
    (root / "sub" / "meta.json").write_text(json.dumps({"prompt": "from json", "width": 48, "height": 32}))
    write_test_clip(root / "nocaption.mp4", frames=12, fps=16)
    write_test_clip(root / "empty.mp4", frames=12, fps=16)
    (root / "empty.txt").write_text("  \n")
    write_test_clip(root / "short.mp4", frames=4, fps=16)
    (root / "short.txt").write_text("too short")
    (root / "broken.mp4").write_bytes(b"\x00" * 100)
    (root / "broken.txt").write_text("broken")
    (root / "orphan.txt").write_text("no clip here")
    assert is_video_input(root)
    listing = list_clips([root])
    assert [s.key for s in listing.samples] == ["broken", "empty", "good", "nocaption", "short", "sub/meta"]
    assert all(isinstance(s, Clip) for s in listing.samples)
    assert listing.samples[2].captions == {"prompt": "a grey square\nthat fades"}
    assert _reasons(listing) == {"orphan.txt": "caption file with no clip beside it"}
    buckets = bucket_table("ASPECT_RATIO_VIDEO_480")
    plan = plan_dataset(listing, buckets, {"prompt": 1}, 0, 0, 8, {}, FrameWindow(num_frames=9, fps=16))
    reasons = _reasons(plan)
    assert reasons["orphan.txt"] == "caption file with no clip beside it"
    assert reasons["nocaption.mp4"].startswith("no caption")
    assert reasons["empty.mp4"] == "empty caption ('prompt')"
    assert reasons["short.mp4"].startswith("too short: 4 frames at 16 fps give 4 frames")
    assert "broken.mp4" in reasons
    planned = sorted(p.sample.key for shard in plan.shards for p in shard.samples)
    assert planned == ["good", "sub/meta"]


def test_image_folder_reports_orphan_captions(tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("an image")
    (tmp_path / "lost.txt").write_text("its image is gone")
    (tmp_path / "lost.json").write_text("{}")
    listing = list_inputs([tmp_path])
    assert [s.key for s in listing.samples] == ["a"]
    assert _reasons(listing) == {
        "lost.json": "caption file with no image beside it",
        "lost.txt": "caption file with no image beside it",
    }


def test_jsonl_manifest_of_clips(tmp_path):
    write_test_clip(tmp_path / "v" / "a.mp4", frames=12, fps=24)
    lines = [
        {"path": "v/a.mp4", "caption": "first", "frames": 12, "fps": 24, "width": 48, "height": 32},
        {"path": "v/a.mp4", "key": "again", "captions": ["x", "y"]},
        {"path": "v/a.mp4", "key": "bad", "caption": "c", "fps": "fast"},
    ]
    manifest = tmp_path / "clips.jsonl"
    manifest.write_text("\n".join(json.dumps(line) for line in lines))
    assert is_video_input(manifest)
    listing = list_clips([manifest])
    first, again = listing.samples
    assert (first.frames, first.fps, first.size) == (12, 24.0, (48, 32))
    assert again.uniform_captions and again.frames is None
    assert [s.reason for s in listing.skipped] == ['bad manifest line ("fps" must be a positive number)']


def test_an_input_in_no_video_layout_is_named_with_the_layouts_expected(tmp_path):
    (tmp_path / "clips.csv").write_text("path,caption\n")
    with pytest.raises(FileNotFoundError, match="input .*clips.csv: expected a folder of clips, a .jsonl manifest"):
        list_clips([tmp_path / "clips.csv"])


def test_sana_zip_layout_with_caption_sidecars_and_motion_score(tmp_path):
    clip = write_test_clip(tmp_path / "src.mp4", frames=12, fps=16)
    zip_path = tmp_path / "zips" / "part_000.zip"
    zip_path.parent.mkdir()
    with zipfile.ZipFile(zip_path, "w") as archive:
        archive.write(clip, "k1.mp4")
        archive.writestr("k1.json", json.dumps({"prompt": "short caption", "height": 32, "width": 48, "frames": 12}))
        archive.write(clip, "k2.mp4")
        archive.writestr("k2.json", json.dumps({"prompt": "", "height": 32, "width": 48, "frames": 12}))
        archive.write(clip, "nojson.mp4")
        archive.writestr("orphan.json", json.dumps({"prompt": "no clip"}))
        archive.writestr("latent.npy", b"\x93NUMPY")
    (tmp_path / "zips" / "part_000_Qwen2.5-VL.json").write_text(json.dumps({"k1": {"prompt": "a long caption"}}))
    (tmp_path / "zips" / "part_000_unimatch.json").write_text(json.dumps({"k1": {"score": [2.0, 5.0]}}))
    (tmp_path / "zips" / "part_000_broken.json").write_text("{")
    root = tmp_path / "zips"
    assert is_video_input(root)
    listing = list_clips([root], ("", "_Qwen2.5-VL", "_broken"))
    k1, k2 = listing.samples
    assert k1.key == "part_000.zip/k1" and (k1.frames, k1.size) == (12, (48, 32))
    assert k1.captions["prompt"] == "short caption motion score: 3."
    assert k1.captions["_Qwen2_5-VL"] == "a long caption motion score: 3."
    assert k2.captions["prompt"] == ""  # empty stays empty: skipped when planned
    reasons = _reasons(listing)
    assert reasons["part_000.zip:nojson.mp4"] == "no nojson.json beside it in the zip"
    assert reasons["part_000.zip:orphan.json"] == "caption file with no clip beside it"
    assert reasons["part_000.zip:latent.npy"].startswith("precomputed latents (.npy) are not read")
    assert reasons["part_000_broken.json"].startswith("unreadable side file")
    assert k1.image.read() == clip.read_bytes()
    assert choose_caption(k1, {"prompt": 5, "_Qwen2_5-VL": 95}, 0)[1].endswith("motion score: 3.")
    maxed = list_clips([zip_path], motion_score="max").samples[0]
    assert maxed.captions["prompt"] == "short caption motion score: 5."
    plan = plan_dataset(listing, bucket_table("ASPECT_RATIO_VIDEO_480"), {"prompt": 1}, 0, 0, 8, {}, FrameWindow(9))
    assert [p.sample.key for p in plan.shards[0].samples] == ["part_000.zip/k1"]
    assert _reasons(plan)["part_000.zip:k2.mp4"] == "empty caption ('prompt')"
