"""Videos out: sana2-sample writes one .mp4 per clip of a video model (a grid on request; --num-frames counts
video frames), and validation writes <dump>/samples/step-<N>/<n>-<prompt>.mp4 and a strip of frames to TensorBoard."""

import json
from pathlib import Path

import pytest
import torch
from checkpoint_factory import save_single_process_run
from train_utils import TINY
from video_factory import tiny_wan_vae, write_test_clip

from sana2.components.sample_files import video_grid
from sana2.components.validator import frame_strips
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


@pytest.mark.slow
def test_sana2_sample_writes_an_mp4_of_video_frames(video_run, tmp_path, capsys):
    out = tmp_path / "clips"
    args = [str(video_run / "step-2"), "--prompt", "a grey clip", "--vae", str(video_run / "vae"), "--steps", "2"]
    size = ["--num-frames", "9", "--height", "32", "--width", "48"]
    assert sample([*args, *size, "--out", str(out)]) == 0
    assert "latents (4, 3, 4, 6)" in capsys.readouterr().out  # 9 video frames are 3 Wan latent frames
    # one prompt x validation.images_per_prompt (2) clips, each in its own file, 16 fps
    names = ["0-a_grey_clip-0.mp4", "0-a_grey_clip-1.mp4"]
    assert sorted(p.name for p in out.iterdir()) == [*names, "sana2_output.json"]
    for name in names:
        info = probe(out / name)
        assert (info.frames, info.fps, info.height, info.width) == (9, 16.0, 32, 48)
    grid = tmp_path / "grid.mp4"
    assert sample([*args, *size, "--grid", "--out", str(grid)]) == 0
    info = probe(grid)  # side by side, 2 white pixels between, none around
    assert (info.frames, info.fps, info.height, info.width) == (9, 16.0, 32, 2 * 48 + 2)
    window = FrameWindow(9, 16.0)
    left = load_clip(grid, window, 32, 98)[..., :48]
    same, other = ((left - load_clip(out / name, window, 32, 48)).abs().mean() for name in names)
    assert same < 0.05 and same < other / 3  # the first clip, through H.264's lossy coding twice
    again = tmp_path / "again.mp4"
    assert sample([*args, *size, "--grid", "--out", str(again)]) == 0
    assert torch.equal(load_clip(grid, window, 32, 98), load_clip(again, window, 32, 98))  # same seed, same clip
    # its own earlier clip is replaced; someone else's is not
    assert sample([*args, *size, "--grid", "--out", str(grid)]) == 0
    foreign = write_test_clip(tmp_path / "mine.mp4", frames=5)
    assert sample([*args, "--num-frames", "5", "--grid", "--out", str(foreign)]) == 2
    assert "refusing" in capsys.readouterr().err and probe(foreign).frames == 5
    assert sample([*args, "--num-frames", "8"]) == 2
    assert "--num-frames 8: expected 4k + 1 video frames" in capsys.readouterr().err
    assert sample([*args, "--num-frames", "5", "--grid", "--out", str(tmp_path / "x.png")]) == 2
    assert "a video model's --grid is a clip" in capsys.readouterr().err
    assert sample([*args, "--num-frames", "5", "--out", str(tmp_path / "x.mp4")]) == 2
    assert "names a file; sana2-sample writes a folder of one file per sample" in capsys.readouterr().err


def test_video_helpers_tile_and_strip_clips():
    videos = torch.rand(3, 3, 5, 8, 8) * 2 - 1
    strips = frame_strips(videos, frames=3)
    assert strips.shape == (3, 3, 8, 24)
    assert torch.equal(strips[:, :, :, 8:16], videos[:, :, 2]) and torch.equal(strips[:, :, :, 16:], videos[:, :, 4])
    grid = video_grid(videos, per_row=3)
    assert grid.shape == (3, 5, 64, 3 * 64 + 4)  # 8x8 frames shown at 64x64, as images are


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
    assert sorted(p.name for p in folder.iterdir()) == ["0-a_grey_clip.mp4", "1-the_same_other.mp4"]
    info = probe(folder / "0-a_grey_clip.mp4")
    assert (info.frames, info.fps, info.height, info.width) == (9, 16.0, 32, 48)
