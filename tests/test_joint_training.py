"""Image-video joint training as Sana's ivjoint trainer: every interval-th step a whole image batch at its own
batch size, both loaders' positions and the step counters in the checkpoint, resume exact at another world size."""

from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from train_utils import full_model_state, run_steps, tiny_config

from sana2.config import ConfigError
from sana2.data.features import FeatureDataset
from sana2.data.joint import JointLoader, is_image_step
from sana2.data.loader import DistributedFeatureLoader
from sana2.data.writer import write_feature_dataset

VIDEO_MODEL = [
    "--model.name=SanaMSVideo",
    "--model.hidden_size=64",
    "--model.depth=2",
    "--model.num_heads=2",
    "--model.linear_head_dim=32",
    "--model.caption_channels=64",
    "--model.model_max_length=5",
    "--model.input_size=8",
]


def _features(path: Path, frames: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(16, 5, dtype=torch.int64)
    mask[::2, 3:] = 0
    latents = torch.randn(16, 16, frames, 8, 8, generator=generator)
    write_feature_dataset(path, latents, torch.randn(16, 5, 64, generator=generator), mask)
    return path


@pytest.fixture(scope="module")
def material(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("joint")
    _features(root / "video", 3, 0)  # Wan latents of 9-frame clips
    _features(root / "images", 1, 1)  # images through the Wan VAE: one-frame latents
    return root


def test_the_schedule_is_sanas_and_its_state_round_trips(material):
    # Sana: is_image_step = interval > 0 and global_step % interval == 0 and global_step > 0
    assert [n for n in range(10) if is_image_step(n, 3)] == [3, 6, 9]
    assert not any(is_image_step(n, 0) for n in range(10))
    video = DistributedFeatureLoader(FeatureDataset(material / "video"), 2, 1, 0, 1, 0)
    images = DistributedFeatureLoader(FeatureDataset(material / "images"), 4, 1, 0, 1, 1)
    joint = JointLoader(video, images, 3)
    kinds = [joint.next_step()[0]["latents"].shape[2] for _ in range(7)]
    assert kinds == [3, 3, 3, 1, 3, 3, 1]  # steps 4 and 7 (counted from 1) are whole image batches of 4
    assert (joint.steps, joint.video_steps, joint.image_steps) == (7, 5, 2)
    state = joint.state_dict()
    expected = joint.next_step()[0]
    again = JointLoader(
        DistributedFeatureLoader(FeatureDataset(material / "video"), 2, 1, 0, 1, 0),
        DistributedFeatureLoader(FeatureDataset(material / "images"), 4, 1, 0, 1, 1),
        3,
    )
    again.load_state_dict(state)
    assert torch.equal(again.next_step()[0]["latents"], expected["latents"])
    with pytest.raises(ValueError, match="joint_training_interval 3, this run uses 2"):
        JointLoader(video, images, 2).load_state_dict(state)


def test_joint_training_needs_images(tmp_path):
    with pytest.raises(ConfigError, match="data.image_path"):
        tiny_config(tmp_path, *VIDEO_MODEL, "--training.joint_training_interval=2")


def _stop_and_resume(rank, world_size, dump, out_file, stop_at, material):
    from sana2 import train

    overrides = [
        *VIDEO_MODEL,
        f"--data.path={material / 'video'}",
        f"--data.image_path={material / 'images'}",
        "--training.joint_training_interval=3",
        "--training.global_batch_size=4",
        "--training.image_global_batch_size=8",
        "--checkpoint.enable=true",
        "--checkpoint.interval=1000",
    ]
    trainer = train.Trainer(tiny_config(dump, *overrides))
    if stop_at is not None:
        losses = run_steps(trainer, stop_at)
        trainer.save_checkpoint(final=True)
    else:
        losses = run_steps(trainer, 8 - trainer.step)
    state = full_model_state(trainer.model)
    if rank == 0:
        counters = trainer.loader.state_dict()
        torch.save({"losses": losses, "state": state, "counters": counters}, out_file)


@pytest.mark.slow
def test_the_joint_schedule_resumes_exactly_at_another_world_size(material, tmp_path):
    run_distributed(_stop_and_resume, 1, tmp_path / "straight", tmp_path / "straight.pt", 8, material)
    run_distributed(_stop_and_resume, 2, tmp_path / "split", tmp_path / "first.pt", 4, material)
    run_distributed(_stop_and_resume, 1, tmp_path / "split", tmp_path / "second.pt", None, material)
    straight, first, second = (torch.load(tmp_path / f"{name}.pt") for name in ("straight", "first", "second"))
    assert (first["counters"]["video_steps"], first["counters"]["image_steps"]) == (3, 1)
    assert (second["counters"]["video_steps"], second["counters"]["image_steps"]) == (6, 2)
    assert second["counters"]["image"]["position"] == straight["counters"]["image"]["position"] == 0  # 2 x 8 of 16
    torch.testing.assert_close(
        torch.tensor(first["losses"] + second["losses"]), torch.tensor(straight["losses"]), atol=1e-5, rtol=0
    )
    for key, value in straight["state"].items():
        torch.testing.assert_close(second["state"][key], value, atol=1e-5, rtol=0, msg=key)
