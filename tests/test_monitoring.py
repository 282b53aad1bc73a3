"""TensorBoard monitoring after real 2-rank runs: the tags, the true global loss, the images."""

import importlib.util
import io
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_utils import full_model_state, run_steps, tiny_config
from wandb_records import wandb_history

from sana2.components.sample_files import sample_names
from sana2.components.sampling import sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.encoders.text_encoder import build_text_encoder
from sana2.models import build_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = '["digit zero", "the number 3", "a drawn seven"]'
STEPS, LOG_FREQ = 6, 2


def events(dump_folder: Path) -> EventAccumulator:
    (run_dir,) = (dump_folder / "tb").iterdir()
    accumulator = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


WANDB = importlib.util.find_spec("wandb") is not None  # an optional tracker: beside TensorBoard where installed


def _run_and_recompute_loss(rank, world_size, dump, out_file):
    """Train with every metric on; independently recompute each logged step's loss on every rank."""
    import torch.distributed as dist

    from sana2.components import flow
    from sana2.train import Trainer

    trainer = Trainer(
        tiny_config(
            dump,
            "--metrics.enable_tensorboard=true",
            f"--metrics.enable_wandb={str(WANDB).lower()}",
            f"--metrics.log_freq={LOG_FREQ}",
            "--metrics.peak_flops=1e12",
            "--validation.enable=true",
            "--validation.freq=3",
            "--validation.at_start=true",
            f"--validation.prompts={PROMPTS}",
            "--validation.images_per_prompt=2",
            "--validation.sampling_steps=3",
            "--validation.num_loss_samples=8",
            "--checkpoint.enable=true",
            "--checkpoint.interval=3",
            f"--training.steps={STEPS}",
            "--training.local_batch_size=4",
            "--training.caption_dropout=0.0",
        )
    )
    predictions = []
    trainer.model.register_forward_hook(lambda module, args, out: predictions.append(out.detach().clone()))
    recomputed = {}
    original_step = trainer.train_step

    def recording_step():
        step = trainer.step + 1
        (indices,) = trainer.loader.step_indices()
        predictions.clear()
        result = original_step()
        batch = trainer.dataset.get_batch(indices.tolist())
        draw = trainer.flow.draw(step, indices, tuple(batch["latents"].shape[1:]))
        _, target = flow.noised(batch["latents"], draw.noise, draw.sigma)
        local = (predictions[0] - target).pow(2).flatten(1).mean(1)
        gathered = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        recomputed[step] = torch.cat(gathered).mean().item()
        return result

    trainer.train_step = recording_step
    trainer.train()
    if rank == 0:
        torch.save(recomputed, out_file)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitoring")
    with pytest.MonkeyPatch.context() as env:  # the workers inherit it: the wandb run stays on disk
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        run_distributed(_run_and_recompute_loss, 2, tmp / "run", tmp / "recomputed.pt")
    return tmp / "run", torch.load(tmp / "recomputed.pt")


@pytest.mark.slow
def test_every_documented_tag_is_logged(two_rank_run):
    dump, _ = two_rank_run
    acc = events(dump)
    scalars = set(acc.Tags()["scalars"])
    expected = {
        "loss",
        "grad_norm",
        "lr",
        "skipped_steps",
        "step_seconds",
        "data_wait_share",
        "samples_per_second",
        "tokens_per_second",
        "mfu",
        "memory/max_over_ranks/peak_rss_gib",
        "memory/rank0/peak_rss_gib",
        "checkpoint/blocking_seconds",
        "validation/loss",
    }
    assert expected <= scalars, expected - scalars
    assert any(tag.startswith("loss/sigma_") for tag in scalars)
    assert [e.step for e in acc.Scalars("loss")] == list(range(LOG_FREQ, STEPS + 1, LOG_FREQ))
    assert [e.step for e in acc.Scalars("validation/loss")] == [0, 3, 6]
    assert [e.step for e in acc.Scalars("checkpoint/blocking_seconds")] == [3, 6]
    assert "config/text_summary" in acc.Tags()["tensors"]
    samples_per_second = acc.Scalars("samples_per_second")[-1].value
    step_seconds = acc.Scalars("step_seconds")[-1].value
    assert samples_per_second == pytest.approx(8 / step_seconds, rel=1e-3)  # global: 2 ranks x 4


@pytest.mark.slow
def test_logged_loss_is_the_mean_over_all_ranks(two_rank_run):
    dump, recomputed = two_rank_run
    for event in events(dump).Scalars("loss"):
        assert event.value == pytest.approx(recomputed[event.step], abs=1e-5)


@pytest.mark.slow
def test_validation_images_have_the_configured_count_and_size(two_rank_run):
    dump, _ = two_rank_run
    images = events(dump).Images("validation/images")
    assert [image.step for image in images] == [0, 3, 6]
    # 3 prompts x 2 images, one prompt per row; 8x8 digits shown 8x enlarged, 1-pixel frames
    side = 8 * 8
    assert (images[0].width, images[0].height) == (2 * side + 3, 3 * side + 4)


@pytest.mark.slow
def test_validation_writes_each_image_to_the_step_folder_as_tensorboard_shows_it(two_rank_run):
    dump, _ = two_rank_run
    names = sample_names(json.loads(PROMPTS), 2, ".png")
    assert sorted(p.name for p in (dump / "samples").iterdir()) == ["step-0", "step-3", "step-6"]
    for logged in events(dump).Images("validation/images"):
        folder = dump / "samples" / f"step-{logged.step}"
        assert sorted(p.name for p in folder.iterdir()) == names
        grid = np.asarray(Image.open(io.BytesIO(logged.encoded_image_string)).convert("L"), dtype=int)
        for index, name in enumerate(names):  # 2 per row, 64x64 cells behind 1-pixel frames
            row, col = divmod(index, 2)
            cell = grid[1 + row * 65 : 65 + row * 65, 1 + col * 65 : 65 + col * 65]
            assert np.abs(np.asarray(Image.open(folder / name), dtype=int) - cell).max() <= 1, name


@pytest.mark.slow
@pytest.mark.skipif(not WANDB, reason="wandb is an optional dependency, not installed here")
def test_weights_and_biases_gets_every_scalar_and_image_tensorboard_gets(two_rank_run):
    """A real 2-rank run logged offline to Weights & Biases: the run's files hold TensorBoard's scalars (the
    trainer's, the validator's, the checkpointer's) at the same steps, and the validation grids."""
    dump, _ = two_rank_run
    (run_folder,) = (dump / "wandb").glob("offline-run-*")
    history = wandb_history(run_folder)
    acc = events(dump)
    for tag in acc.Tags()["scalars"]:
        logged = {step: values[tag] for step, values in history.items() if tag in values}
        assert logged == pytest.approx({e.step: e.value for e in acc.Scalars(tag)}, rel=1e-6), tag
    assert {"validation/loss", "checkpoint/blocking_seconds", "loss"} <= set(history[6])
    key = "validation/images/path"
    grids = {step: values[key] for step, values in history.items() if key in values}
    assert sorted(grids) == [0, 3, 6]
    for image in acc.Images("validation/images"):
        ours = np.asarray(Image.open(run_folder / "files" / grids[image.step]).convert("RGB"), dtype=int)
        theirs = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"), dtype=int)
        assert ours.shape == theirs.shape and np.abs(ours - theirs).max() <= 1


def _sharded_sampling(rank, world_size, dump, out_file):
    from sana2.train import Trainer

    trainer = Trainer(
        tiny_config(
            dump,
            f"--validation.prompts={PROMPTS}",
            "--validation.enable=true",
            "--validation.sampling_steps=4",
            "--validation.num_loss_samples=0",
        )
    )
    trainer.validator.run(0)
    full = full_model_state(trainer.model)
    torch.save({"images": trainer.validator.last_images.cpu(), "state": full}, f"{out_file}.{rank}")


@pytest.mark.slow
def test_sharded_validation_sampling_matches_the_consolidated_model(tmp_path):
    run_distributed(_sharded_sampling, 2, tmp_path / "run", tmp_path / "sampled")
    rank0, rank1 = (torch.load(tmp_path / f"sampled.{rank}") for rank in range(2))
    torch.testing.assert_close(rank1["images"], rank0["images"], atol=0, rtol=0)
    config = tiny_config(tmp_path / "run", f"--validation.prompts={PROMPTS}")
    model = build_model(config.model.name, **config.model.overrides)
    model.load_state_dict(rank0["state"])
    prompts = [p for p in config.validation.prompts for _ in range(config.validation.images_per_prompt)]
    encoder = build_text_encoder(config.encoding.text_encoder, config.caption_length)
    (embeds, mask), (_, null_mask) = encoder.encode(prompts), encoder.null_caption()
    noise = sampling_noise(config.validation.seed, len(prompts), (1, 8, 8))
    scheduler = build_scheduler(scheduler_config(config.validation.scheduler, config.training.flow_shift))
    single = flow_sample(model, noise, embeds[:, None], mask, null_mask, 4, config.validation.cfg_scale, scheduler)
    # fp32 all-gathers rebuild the weights exactly; only reduction order inside kernels may differ
    torch.testing.assert_close(rank0["images"], single, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_default_run_images_change_and_validation_loss_falls(tmp_path):
    """./run_train.sh with the default config, shortened to 60 steps and two validations."""
    dump = tmp_path / "debug"
    env = {**os.environ, "CONFIG_FILE": str(ROOT / "train_configs/debug_model.toml")}
    subprocess.run(
        [
            str(ROOT / "run_train.sh"),
            f"--job.dump_folder={dump}",
            "--training.steps=60",
            "--validation.freq=60",
            "--lr_scheduler.warmup_steps=10",
            "--checkpoint.interval=60",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    acc = events(dump)
    losses = {e.step: e.value for e in acc.Scalars("validation/loss")}
    assert sorted(losses) == [0, 60]
    assert losses[60] < 0.8 * losses[0]
    first, last = acc.Images("validation/images")
    assert (first.step, last.step) == (0, 60)
    start = np.asarray(Image.open(io.BytesIO(first.encoded_image_string)), dtype=np.float32)
    end = np.asarray(Image.open(io.BytesIO(last.encoded_image_string)), dtype=np.float32)
    assert np.abs(start - end).mean() > 10  # of 255: the samples changed visibly
    assert (dump / "checkpoint" / "step-60" / "COMPLETE").is_file()


def _train_around_ema_sampling(rank, world_size, dump, out_file, sample):
    from sana2.train import Trainer

    trainer = Trainer(
        tiny_config(
            dump,
            "--training.ema_decay=0.5",
            "--validation.enable=true",
            "--validation.use_ema=true",
            "--parallelism.reshard_after_forward=false",
            f"--validation.prompts={PROMPTS}",
            "--validation.sampling_steps=2",
            "--validation.num_loss_samples=8",
            "--training.local_batch_size=4",
        )
    )
    losses = run_steps(trainer, 2)
    if sample:
        trainer.validator.run(trainer.step)
    losses += run_steps(trainer, 2)
    state = full_model_state(trainer.model)
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out_file)


@pytest.mark.slow
def test_sampling_with_ema_weights_leaves_training_untouched(tmp_path):
    """EMA weights swapped in for sampling must not leak into the next steps, even where FSDP keeps
    parameters gathered between forward and backward (reshard_after_forward = false)."""
    run_distributed(_train_around_ema_sampling, 2, tmp_path / "a", tmp_path / "with.pt", True)
    run_distributed(_train_around_ema_sampling, 2, tmp_path / "b", tmp_path / "without.pt", False)
    with_sampling, without = torch.load(tmp_path / "with.pt"), torch.load(tmp_path / "without.pt")
    assert with_sampling["losses"] == without["losses"]
    for key, value in without["state"].items():
        assert torch.equal(with_sampling["state"][key], value), key
