"""sana2.sample: images from any checkpoint form, deterministic per seed, drawn by the validator's sampler."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_factory import save_single_process_run
from diffusers import AutoencoderDC
from dist_utils import free_port
from PIL import Image
from train_utils import TINY

from sana2.components.initial_load import load_initial_weights
from sana2.components.sampling import make_grid, sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.components.validator import for_display
from sana2.config import load_config
from sana2.encoders.text_encoder import build_text_encoder
from sana2.models import build_model
from sana2.sample import main as sample
from sana2.tools.convert_checkpoint import main as convert

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("the number 7", "digit zero")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A step folder of the tiny digits model, trained 3 steps with EMA, and its exports beside it."""
    root = tmp_path_factory.mktemp("sample")
    config = load_config(None, [*TINY, "--training.ema_decay=0.9", "--validation.images_per_prompt=2"])
    save_single_process_run(root / "step-3", config, steps=3)
    for output, flags in (
        ("accelerate", []),
        ("model.pth", ["--format", "pth"]),
        ("ema.pth", ["--format", "pth", "--ema"]),
        ("model.safetensors", ["--format", "safetensors"]),
        ("diffusers", ["--format", "diffusers"]),
    ):
        assert convert([str(root / "step-3"), str(root / output), *flags]) == 0
    return root


def draw(checkpoint: Path, out: Path, *flags: str) -> np.ndarray:
    args = [str(checkpoint), "--out", str(out), "--steps", "4", *flags]
    assert sample([*args, *(f for prompt in PROMPTS for f in ("--prompt", prompt))]) == 0
    return np.asarray(Image.open(out))


def test_same_seed_same_image_other_seed_other_image(run, tmp_path):
    first = draw(run / "step-3", tmp_path / "a.png", "--seed", "1")
    again = draw(run / "step-3", tmp_path / "b.png", "--seed", "1")
    other = draw(run / "step-3", tmp_path / "c.png", "--seed", "2")
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    # two rows (prompts) of two images (validation.images_per_prompt), 8x8 shown at 64x64, 2-pixel frames
    assert first.shape == (2 * 66 + 2, 2 * 66 + 2) and first.dtype == np.uint8


@pytest.mark.parametrize(
    "form",
    ["accelerate/epoch_1_step_3.pth", "accelerate/latest.pth/model", "model.pth", "model.safetensors", "diffusers"],
)
def test_every_export_of_a_checkpoint_draws_the_same_image(run, tmp_path, form):
    expected = draw(run / "step-3", tmp_path / "dcp.png")
    config = ["--config", str(run / "step-3" / "config.toml")] if form != "diffusers" else []  # diffusers: its own
    assert np.array_equal(draw(run / form, tmp_path / "export.png", *config), expected)


def test_ema_weights_are_drawn_from_a_dcp_checkpoint_and_refused_from_a_single_file(run, tmp_path, capsys):
    ema = draw(run / "step-3", tmp_path / "ema.png", "--ema")
    assert not np.array_equal(ema, draw(run / "step-3", tmp_path / "model.png"))
    config = ["--config", str(run / "step-3" / "config.toml")]
    assert np.array_equal(ema, draw(run / "ema.pth", tmp_path / "exported.png", *config))
    assert sample([str(run / "model.pth"), "--prompt", "x", "--ema", *config]) == 2
    assert "EMA weights come from a DCP training checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("scheduler", ["dpm-solver", "euler"])
def test_the_png_is_the_validators_sample(run, tmp_path, scheduler):
    """The CLI composes the validator's pieces: the picture is flow_sample's output as the validator shows it."""
    flags = ["--cfg", "2.5", "--seed", "3", "--images-per-prompt", "1", "--scheduler", scheduler]
    image = draw(run / "step-3", tmp_path / "grid.png", *flags)
    config = load_config(run / "step-3" / "config.toml")
    model = build_model(config.model.name, **config.model.overrides)
    load_initial_weights(model, run / "step-3")
    encoder = build_text_encoder(config.encoding.text_encoder, config.caption_length)
    (embeds, mask), (_, null_mask) = encoder.encode(list(PROMPTS)), encoder.null_caption()
    noise = sampling_noise(3, 2, (1, 8, 8))
    steps = build_scheduler(scheduler_config(scheduler, config.training.flow_shift))
    latents = flow_sample(model, noise, embeds[:, None], mask, null_mask, 4, 2.5, steps)
    grid = make_grid(for_display(latents), nrow=1, padding=2, pad_value=1.0)
    expected = ((grid[0] + 1) * 127.5).round().to(torch.uint8).numpy()
    assert np.array_equal(image, expected)


def test_a_folder_without_null_caption_is_guided_against_the_empty_prompt(run, tmp_path, capsys):
    released = tmp_path / "released"
    released.mkdir()
    for file in (run / "diffusers").iterdir():
        if file.name != "sana2_null_caption.safetensors":
            (released / file.name).write_bytes(file.read_bytes())
    image = draw(released, tmp_path / "released.png")
    assert "holds no null caption; guided against the empty prompt" in capsys.readouterr().out
    assert not np.array_equal(image, draw(run / "diffusers", tmp_path / "own.png"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--height", "0"], "--height 0: expected a positive multiple of 1 pixels"),
        # the caption length is the model's (model_max_length): a run trained at 16 tokens is no 8-token model
        (["--caption-length", "8"], "y_embedder.y_embedding has shape (16, 64), this run needs (8, 64)"),
        (["--num-frames", "5"], "--num-frames applies to video models only"),
        (["--model", "SanaMS_debug"], "does not match this run"),
    ],
)
def test_bad_arguments_fail_with_one_line_and_exit_2(run, tmp_path, capsys, flags, message):
    assert sample([str(run / "step-3"), "--prompt", "x", "--out", str(tmp_path / "x.png"), *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


def test_a_missing_checkpoint_fails_naming_it(tmp_path, capsys):
    assert sample([str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert f"checkpoint {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_under_torchrun_the_sharded_model_draws_the_same_image(run, tmp_path):
    expected = draw(run / "step-3", tmp_path / "single.png")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "-m",
        "sana2.sample",
        str(run / "step-3"),
        "--out",
        str(tmp_path / "sharded.png"),
        "--steps",
        "4",
        *(f for prompt in PROMPTS for f in ("--prompt", prompt)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "sharded.png")), expected)


@pytest.mark.slow
def test_console_script_and_module_run(tmp_path):
    script = Path(sys.executable).parent / "sana2-sample"
    for command in ([sys.executable, "-m", "sana2.sample", "--help"], [script, "--help"]):
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "--cfg" in result.stdout


def test_a_vae_decodes_the_latents_at_the_requested_pixel_size(run, tmp_path, capsys):
    vae = AutoencoderDC(  # 2 blocks: one latent covers 2x2 pixels; 1 latent channel, as the digits model draws
        latent_channels=1,
        attention_head_dim=8,
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), ()),
        decoder_qkv_multiscales=((), ()),
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        scaling_factor=0.5,
    )
    vae.save_pretrained(tmp_path / "vae")
    image = draw(
        run / "step-3", tmp_path / "decoded.png", "--vae", str(tmp_path / "vae"), "--height", "32", "--width", "16"
    )
    # latents (1, 16, 8) decode to 3 x 32 x 16 pixels, shown 4x enlarged, 2 prompts x 2 images with 2-pixel frames
    assert image.shape == (2 * (128 + 2) + 2, 2 * (64 + 2) + 2, 3)
    assert "latents (1, 16, 8)" in capsys.readouterr().out
    assert sample([str(run / "step-3"), "--prompt", "x", "--vae", str(tmp_path / "vae"), "--height", "15"]) == 2
    assert "--height 15: expected a positive multiple of 2 pixels" in capsys.readouterr().err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "target, message",
    [
        ("dump", "refusing to write {out}: it is a folder, and this output is a file"),
        ("checkpoint", "refusing to write {out}: it is one of this command's inputs"),
        ("inside checkpoint", "refusing to write {out}: it lies inside the input {checkpoint}"),
        ("photo", "refusing to replace {out}: it is not an earlier sana2-sample output"),
        ("cwd", "refusing to write .: it is a folder"),
    ],
)
def test_out_never_replaces_what_this_command_did_not_write(run, tmp_path, monkeypatch, capsys, target, message):
    """A folder (a dump folder, the checkpoint, the working directory), a file inside the checkpoint or a
    PNG from elsewhere at --out: exit 2 naming it, before any sampling, with everything there kept."""
    checkpoint = tmp_path / "step-3"
    shutil.copytree(run / "step-3", checkpoint)
    dump = tmp_path / "dump"
    (dump / "checkpoint").mkdir(parents=True)
    (dump / "checkpoint" / "notes.txt").write_text("mine")
    Image.new("RGB", (4, 4), "red").save(tmp_path / "photo.png")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    out = {
        "dump": dump,
        "checkpoint": checkpoint,
        "inside checkpoint": checkpoint / "grid.png",
        "photo": tmp_path / "photo.png",
        "cwd": Path("."),
    }[target]
    before = _tree(tmp_path)
    assert sample([str(checkpoint), "--prompt", "x", "--out", str(out), "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert message.format(out=out, checkpoint=checkpoint) in error and error.count("\n") == 1, error
    assert _tree(tmp_path) == before


def test_an_earlier_grid_of_this_command_is_replaced(run, tmp_path):
    first = draw(run / "step-3", tmp_path / "grid.png", "--seed", "1")
    assert not np.array_equal(draw(run / "step-3", tmp_path / "grid.png", "--seed", "2"), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]


def _tiny_dc_ae(folder: Path, latent_channels: int) -> Path:
    AutoencoderDC(
        latent_channels=latent_channels,
        attention_head_dim=8,
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        encoder_qkv_multiscales=((), ()),
        decoder_qkv_multiscales=((), ()),
        upsample_block_type="interpolate",
        downsample_block_type="Conv",
        scaling_factor=0.5,
    ).save_pretrained(folder)
    return folder


def _broken_diffusers_folder(run: Path, tmp_path: Path, damage: str) -> Path:
    folder = tmp_path / "diffusers"
    shutil.copytree(run / "diffusers", folder)
    config = json.loads((folder / "config.json").read_text())
    if damage == "missing key":
        del config["num_layers"]
        (folder / "config.json").write_text(json.dumps(config))
    elif damage == "foreign":
        (folder / "config.json").write_text(json.dumps({**config, "_class_name": "UNet2DConditionModel"}))
    else:
        (folder / "config.json").write_text("{not json")
    return folder


@pytest.mark.parametrize(
    "case, message",
    [
        ("--cfg nan", "--cfg nan: expected a finite number"),
        ("--cfg inf", "--cfg inf: expected a finite number"),
        ("vae channels", "has 4 latent channels; the model SanaMS_digits takes 1"),
        ("missing key", "SanaTransformer2DModel config has no 'num_layers'"),
        ("foreign", "describes 'UNet2DConditionModel', not a Sana transformer"),
        ("not json", "config.json is not valid JSON"),
        ("read-only", "is not writable (a read-only filesystem, or no permission)"),
        ("read-only at write", "cannot write --out {out}: Read-only file system"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_sampling(run, tmp_path, monkeypatch, capsys, case, message):
    """A nan guidance scale, a VAE of other latent channels, a diffusers config.json missing a key, foreign or
    damaged, an output on a read-only filesystem: one line naming it, exit 2, no sampling step run."""
    from sana2 import sample as sample_module
    from sana2 import staging

    checkpoint, flags, out = run / "step-3", [], tmp_path / "grid.png"
    steps = []
    real_sample = sample_module.flow_sample
    monkeypatch.setattr(sample_module, "flow_sample", lambda *a, **k: steps.append(1) or real_sample(*a, **k))
    if case.startswith("--cfg"):
        flags = case.split()
    elif case == "vae channels":
        flags = ["--vae", str(_tiny_dc_ae(tmp_path / "vae", latent_channels=4))]
    elif case in ("missing key", "foreign", "not json"):
        checkpoint = _broken_diffusers_folder(run, tmp_path, case)
    elif case == "read-only":  # as root, permissions do not stop writes: a read-only mount answers access() so
        monkeypatch.setattr(staging.os, "access", lambda path, mode: False)
    else:

        def read_only(self, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[0]))

        monkeypatch.setattr(Image.Image, "save", read_only)
    assert sample([str(checkpoint), "--prompt", "x", "--out", str(out), "--steps", "1", *flags]) == 2
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and message.format(out=out) in error[0], error
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert steps == ([1] if case == "read-only at write" else [])
