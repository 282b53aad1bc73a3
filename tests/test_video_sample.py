"""Videos out: sana2-sample writes an .mp4 grid for a video model (--num-frames counts video frames), and
validation writes <dump>/samples/step-<N>/<prompt>.mp4 and a strip of frames to TensorBoard."""

import json
from pathlib import Path

import pytest
import torch
from checkpoint_factory import save_single_process_run
from train_utils import TINY
from video_factory import tiny_wan_vae, write_test_clip

from sana2.components.validator import clip_names, frame_strips, video_grid
from sana2.config import load_config
from sana2.data.video_decode import FrameWindow, load_clip, probe
from sana2.sample import main as sample

VIDEO_MODEL = {
    "name": "SanaMSVideo",
    "in_channels": 4,  # the tiny Wan VAE's latent channels
    "caption_channels": 64,  # tiny-t5's width
    "model_max_length": 16,
    "input_size": 4,
    "linear_head_dim": 32,
}


@pytest.fixture(scope="module")
def video_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video_sample")
    tiny_wan_vae(root / "vae")
    overrides = [*TINY, *(f"--model.{key}={json.dumps(value)}" for key, value in VIDEO_MODEL.items())]
    overrides[0] = "--model.name=SanaMSVideo"
    save_single_process_run(root / "step-2", load_config(None, overrides), steps=2)
    return root


def test_sana2_sample_writes_an_mp4_of_video_frames(video_run, tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    args = [str(video_run / "step-2"), "--prompt", "a grey clip", "--vae", str(video_run / "vae"), "--steps", "2"]
    assert sample([*args, "--num-frames", "9", "--height", "32", "--width", "48", "--out", str(out)]) == 0
    assert "latents (4, 3, 4, 6)" in capsys.readouterr().out  # 9 video frames are 3 Wan latent frames
    info = probe(out)
    # one prompt x validation.images_per_prompt (2) clips side by side, 2-pixel frames, 16 fps
    assert (info.frames, info.fps, info.height, info.width) == (9, 16.0, 32 + 4, 2 * (48 + 2) + 2)
    again = tmp_path / "again.mp4"
    assert sample([*args, "--num-frames", "9", "--height", "32", "--width", "48", "--out", str(again)]) == 0
    window = FrameWindow(9, 16.0)
    assert torch.equal(load_clip(out, window, 36, 102), load_clip(again, window, 36, 102))  # same seed, same clip
    # its own earlier clip is replaced; someone else's is not
    assert sample([*args, "--num-frames", "9", "--height", "32", "--width", "48", "--out", str(out)]) == 0
    foreign = write_test_clip(tmp_path / "mine.mp4", frames=5)
    assert sample([*args, "--num-frames", "5", "--out", str(foreign)]) == 2
    assert "refusing" in capsys.readouterr().err and probe(foreign).frames == 5
    assert sample([*args, "--num-frames", "8"]) == 2
    assert "--num-frames 8: expected 4k + 1 video frames" in capsys.readouterr().err
    assert sample([*args, "--num-frames", "5", "--out", str(tmp_path / "x.png")]) == 2
    assert "a video model writes a clip" in capsys.readouterr().err


def test_video_helpers_name_tile_and_strip_clips():
    assert clip_names(["a cat / dog", "a cat / dog"], 2) == ["a_cat_dog-0.mp4", "a_cat_dog-1.mp4"]
    assert clip_names(["x?", "x!"], 1) == ["x.mp4", "x_1.mp4"]
    videos = torch.rand(3, 3, 5, 8, 8) * 2 - 1
    strips = frame_strips(videos, frames=3)
    assert strips.shape == (3, 3, 8, 24)
    assert torch.equal(strips[:, :, :, 8:16], videos[:, :, 2]) and torch.equal(strips[:, :, :, 16:], videos[:, :, 4])
    grid = video_grid(videos, per_row=3)
    assert grid.shape[:2] == (3, 5)


def _validate(rank, world_size, dump, features, vae):
    from sana2.train import Trainer

    overrides = [*TINY, *(f"--model.{key}={json.dumps(value)}" for key, value in VIDEO_MODEL.items())]
    overrides[0] = "--model.name=SanaMSVideo"
    overrides += [
        f"--job.dump_folder={dump}",
        f"--data.path={features}",
        f"--validation.vae={vae}",
        "--validation.enable=true",
        "--validation.at_start=false",
        "--validation.prompts=['a grey clip', 'the same / other']",
        "--validation.images_per_prompt=1",
        "--validation.sampling_steps=2",
        "--validation.num_loss_samples=0",
        "--training.global_batch_size=4",
    ]
    trainer = Trainer(load_config(None, overrides))
    trainer.validator.run(7)


@pytest.mark.slow
def test_validation_of_a_video_model_writes_mp4_clips(video_run, tmp_path):
    from dist_utils import run_distributed

    from sana2.data.writer import write_feature_dataset

    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(8, 4, 3, 4, 6, generator=generator)  # Wan latents of 9-frame 32x48 clips
    write_feature_dataset(tmp_path / "features", latents, torch.randn(8, 16, 64), torch.ones(8, 16, dtype=torch.int64))
    run_distributed(_validate, 1, tmp_path / "dump", tmp_path / "features", video_run / "vae")
    folder = tmp_path / "dump" / "samples" / "step-7"
    assert sorted(p.name for p in folder.iterdir()) == ["a_grey_clip.mp4", "the_same_other.mp4"]
    info = probe(folder / "a_grey_clip.mp4")
    assert (info.frames, info.fps, info.height, info.width) == (9, 16.0, 32, 48)
