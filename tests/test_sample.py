"""sana2.sample: images from any checkpoint form, deterministic per seed, drawn by the validator's sampler, one
file per image named after its prompt (or one grid), replacing only its own earlier output."""

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
from sana2.components.sample_files import for_display, image_grid, sample_names
from sana2.components.sampling import sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.config import load_config
from sana2.data.features import most_common_latent_shape
from sana2.data.writer import write_feature_dataset
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
    """The images sana2-sample writes to the folder `out` (in file-name order, stacked), or its --grid."""
    args = [str(checkpoint), "--out", str(out), "--steps", "4", *flags]
    assert sample([*args, *(f for prompt in PROMPTS for f in ("--prompt", prompt))]) == 0
    if "--grid" in flags:
        return np.asarray(Image.open(out))
    return np.stack([np.asarray(Image.open(file)) for file in sorted(out.glob("*.png"))])


def test_one_file_per_image_named_after_its_prompt_without_a_frame(run, tmp_path, capsys):
    first = draw(run / "step-3", tmp_path / "a", "--seed", "1")
    names = ["0-the_number_7-0.png", "0-the_number_7-1.png", "1-digit_zero-0.png", "1-digit_zero-1.png"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [*names, "sana2_output.json"]
    assert f"wrote {tmp_path / 'a'} (4 files of 64x64)" in capsys.readouterr().out
    # each image alone: 8x8 digits shown at 64x64 (as TensorBoard shows them), no white frame
    assert first.shape == (4, 64, 64) and first.dtype == np.uint8
    marker = json.loads((tmp_path / "a" / "sana2_output.json").read_text())
    assert marker == {"kind": "sana2-sample", "files": names}
    assert Image.open(tmp_path / "a" / names[0]).info["Software"] == "sana2-sample"


def test_same_seed_same_image_other_seed_other_image(run, tmp_path):
    first = draw(run / "step-3", tmp_path / "a", "--seed", "1")
    again = draw(run / "step-3", tmp_path / "b", "--seed", "1")
    other = draw(run / "step-3", tmp_path / "c", "--seed", "2")
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_the_grid_on_request_tiles_the_files_with_white_between_them_only(run, tmp_path):
    files = draw(run / "step-3", tmp_path / "files")
    grid = draw(run / "step-3", tmp_path / "grid.png", "--grid")
    # two rows (prompts) of two images (validation.images_per_prompt), 2 white pixels between, none around
    assert grid.shape == (2 * 64 + 2, 2 * 64 + 2)
    for index, (top, left) in enumerate([(0, 0), (0, 66), (66, 0), (66, 66)]):
        assert np.array_equal(grid[top : top + 64, left : left + 64], files[index])
    assert (grid[64:66] == 255).all() and (grid[:, 64:66] == 255).all()
    single = draw(run / "step-3", tmp_path / "one.png", "--grid", "--images-per-prompt", "1", "--seed", "5")
    alone = draw(run / "step-3", tmp_path / "one", "--images-per-prompt", "1", "--seed", "5")
    assert np.array_equal(single[:64], alone[0])  # the first prompt's image, framed by nothing


def test_file_names_are_stable_unique_and_in_prompt_order():
    assert sample_names(["a cat / dog", "a cat / dog"], 2, ".png") == [
        "0-a_cat_dog-0.png",
        "0-a_cat_dog-1.png",
        "1-a_cat_dog-0.png",
        "1-a_cat_dog-1.png",
    ]
    many = sample_names([f"x{'?' if i % 2 else '!'}" for i in range(11)], 1, ".mp4")
    assert many[:2] == ["00-x.mp4", "01-x.mp4"] and len(set(many)) == 11 and many == sorted(many)
    assert sample_names(["", "日本", "../../etc/passwd", "a" * 200], 1, ".png") == [
        "0-prompt.png",
        "1-prompt.png",
        "2-etc_passwd.png",
        f"3-{'a' * 60}.png",
    ]


@pytest.mark.parametrize(
    "form",
    ["accelerate/epoch_1_step_3.pth", "accelerate/latest.pth/model", "model.pth", "model.safetensors", "diffusers"],
)
def test_every_export_of_a_checkpoint_draws_the_same_image(run, tmp_path, form):
    expected = draw(run / "step-3", tmp_path / "dcp")
    config = ["--config", str(run / "step-3" / "config.toml")] if form != "diffusers" else []  # diffusers: its own
    assert np.array_equal(draw(run / form, tmp_path / "export", *config), expected)


def test_ema_weights_are_drawn_from_a_dcp_checkpoint_and_refused_from_a_single_file(run, tmp_path, capsys):
    ema = draw(run / "step-3", tmp_path / "ema", "--ema")
    assert not np.array_equal(ema, draw(run / "step-3", tmp_path / "model"))
    config = ["--config", str(run / "step-3" / "config.toml")]
    assert np.array_equal(ema, draw(run / "ema.pth", tmp_path / "exported", *config))
    assert sample([str(run / "model.pth"), "--prompt", "x", "--ema", *config]) == 2
    assert "EMA weights come from a DCP training checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("scheduler", ["dpm-solver", "euler"])
def test_the_png_is_the_validators_sample(run, tmp_path, scheduler):
    """The CLI composes the validator's pieces: each picture is flow_sample's output as the validator shows it."""
    flags = ["--cfg", "2.5", "--seed", "3", "--images-per-prompt", "1", "--scheduler", scheduler]
    images = draw(run / "step-3", tmp_path / "samples", *flags)
    config = load_config(run / "step-3" / "config.toml")
    model = build_model(config.model.name, **config.model.overrides)
    load_initial_weights(model, run / "step-3")
    encoder = build_text_encoder(config.encoding.text_encoder, config.caption_length)
    (embeds, mask), (_, null_mask) = encoder.encode(list(PROMPTS)), encoder.null_caption()
    noise = sampling_noise(3, 2, (1, 8, 8))
    steps = build_scheduler(scheduler_config(scheduler, config.training.flow_shift))
    latents = flow_sample(model, noise, embeds[:, None], mask, null_mask, 4, 2.5, steps)
    expected = ((for_display(latents)[:, 0] + 1) * 127.5).round().to(torch.uint8).numpy()
    assert np.array_equal(images, expected)
    grid = ((image_grid(for_display(latents), 1)[0] + 1) * 127.5).round().to(torch.uint8).numpy()
    assert np.array_equal(draw(run / "step-3", tmp_path / "grid.png", *flags, "--grid"), grid)


def test_a_folder_without_null_caption_is_guided_against_the_empty_prompt(run, tmp_path, capsys):
    released = tmp_path / "released"
    released.mkdir()
    for file in (run / "diffusers").iterdir():
        if file.name != "sana2_null_caption.safetensors":
            (released / file.name).write_bytes(file.read_bytes())
    image = draw(released, tmp_path / "released_samples")
    assert "holds no null caption; guided against the empty prompt" in capsys.readouterr().out
    assert not np.array_equal(image, draw(run / "diffusers", tmp_path / "own"))


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
    assert sample([str(run / "step-3"), "--prompt", "x", "--out", str(tmp_path / "x"), *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_a_missing_checkpoint_fails_naming_it(tmp_path, capsys):
    assert sample([str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert f"checkpoint {tmp_path / 'nothing'} does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_under_torchrun_the_sharded_model_draws_the_same_image(run, tmp_path):
    expected = draw(run / "step-3", tmp_path / "single")
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
        str(tmp_path / "sharded"),
        "--steps",
        "4",
        *(f for prompt in PROMPTS for f in ("--prompt", prompt)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert np.array_equal(
        np.stack([np.asarray(Image.open(f)) for f in sorted((tmp_path / "sharded").glob("*.png"))]), expected
    )


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
    images = draw(
        run / "step-3", tmp_path / "decoded", "--vae", str(tmp_path / "vae"), "--height", "32", "--width", "16"
    )
    # latents (1, 16, 8) decode to 3 x 32 x 16 pixels, shown 4x enlarged, 2 prompts x 2 images
    assert images.shape == (4, 128, 64, 3)
    assert "latents (1, 16, 8)" in capsys.readouterr().out
    assert sample([str(run / "step-3"), "--prompt", "x", "--vae", str(tmp_path / "vae"), "--height", "15"]) == 2
    assert "--height 15: expected a positive multiple of 2 pixels" in capsys.readouterr().err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "target, message",
    [
        ("dump", "refusing to write {out}: it is or lies inside the training run's folder {dump}"),
        ("inside dump", "refusing to write {out}: it is or lies inside the training run's folder {dump}"),
        ("checkpoint", "refusing to write {out}: it is or lies inside the training run's folder {checkpoint}"),
        ("holds checkpoint", "refusing to write {out}: it contains the input {source}"),
        ("input folder", "refusing to write {out}: it is one of this command's inputs"),
        ("inside input", "refusing to write {out}: it lies inside the input {source}"),
        ("user folder", "refusing to replace {out}: it is not an earlier sana2-sample output"),
        ("photo", "--out {out}: names a file; sana2-sample writes a folder of one file per sample"),
        ("photo grid", "refusing to replace {out}: it is not an earlier sana2-sample output"),
        ("folder grid", "refusing to write {out}: it is a folder, and this output is a file"),
        ("cwd", "refusing to write .: it is the working directory or holds it"),
        ("parent of cwd", "refusing to write ..: it is the working directory or holds it"),
    ],
)
def test_out_never_replaces_what_this_command_did_not_write(run, tmp_path, monkeypatch, capsys, target, message):
    """A training run's folder or anything in it, the checkpoint or a folder holding it, a user's folder, a
    PNG from elsewhere, the working directory at --out: exit 2 naming it, before any sampling, with everything
    there kept."""
    dump = tmp_path / "dump"
    checkpoint = dump / "checkpoint" / "step-3"
    shutil.copytree(run / "step-3", checkpoint)
    (tmp_path / "copies").mkdir()
    shutil.copy(run / "model.pth", tmp_path / "copies" / "model.pth")
    shutil.copytree(run / "diffusers", tmp_path / "diffusers")
    (dump / "config.toml").write_text((checkpoint / "config.toml").read_text())  # as the trainer leaves it
    (dump / "checkpoint" / "notes.txt").write_text("mine")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "album.png").mkdir()
    Image.new("RGB", (4, 4), "red").save(tmp_path / "album.png" / "photo.png")
    Image.new("RGB", (4, 4), "red").save(tmp_path / "photo.png")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    out, source, flags = {
        "dump": (dump, checkpoint, []),
        "inside dump": (dump / "samples", checkpoint, []),
        "checkpoint": (checkpoint, checkpoint, []),
        "holds checkpoint": (tmp_path / "copies", tmp_path / "copies" / "model.pth", []),
        "input folder": (tmp_path / "diffusers", tmp_path / "diffusers", []),
        "inside input": (tmp_path / "diffusers" / "samples", tmp_path / "diffusers", []),
        "user folder": (tmp_path / "mine", checkpoint, []),
        "photo": (tmp_path / "photo.png", checkpoint, []),
        "photo grid": (tmp_path / "photo.png", checkpoint, ["--grid"]),
        "folder grid": (tmp_path / "album.png", checkpoint, ["--grid"]),
        "cwd": (Path("."), checkpoint, []),
        "parent of cwd": (Path(".."), checkpoint, []),
    }[target]
    config = ["--config", str(checkpoint / "config.toml")] if source.suffix == ".pth" else []
    before = _tree(tmp_path)
    assert sample([str(source), "--prompt", "x", "--out", str(out), "--steps", "1", *config, *flags]) == 2
    error = capsys.readouterr().err
    assert (
        message.format(out=out, checkpoint=checkpoint, dump=dump, source=source) in error and error.count("\n") == 1
    ), error
    assert _tree(tmp_path) == before


def test_an_earlier_output_of_this_command_is_replaced_whole(run, tmp_path):
    first = draw(run / "step-3", tmp_path / "out", "--seed", "1")
    args = [str(run / "step-3"), "--out", str(tmp_path / "out"), "--steps", "4", "--seed", "2"]
    assert sample([*args, "--prompt", "a seven"]) == 0  # fewer prompts: the earlier files go with the old output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "0-a_seven-0.png",
        "0-a_seven-1.png",
        "sana2_output.json",
    ]
    again = draw(run / "step-3", tmp_path / "out", "--seed", "1")
    assert np.array_equal(again, first) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    grid = draw(run / "step-3", tmp_path / "grid.png", "--grid", "--seed", "1")
    assert not np.array_equal(draw(run / "step-3", tmp_path / "grid.png", "--grid", "--seed", "2"), grid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png", "out"]


def test_an_earlier_output_holding_a_users_file_is_kept(run, tmp_path, capsys):
    """A file the user put into an earlier output folder: the folder is not replaced, and says why."""
    draw(run / "step-3", tmp_path / "out", "--seed", "1")
    (tmp_path / "out" / "best.png").write_bytes((tmp_path / "out" / "0-the_number_7-0.png").read_bytes())
    (tmp_path / "out" / "notes.txt").write_text("mine")
    before = _tree(tmp_path)
    assert sample([str(run / "step-3"), "--prompt", "x", "--out", str(tmp_path / "out"), "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert (
        f"refusing to replace {tmp_path / 'out'}: besides the earlier sana2-sample output it holds best.png, " in error
    )
    assert "notes.txt, which sana2-sample did not write" in error and error.count("\n") == 1
    assert _tree(tmp_path) == before


def test_the_default_size_is_the_one_the_run_trained_at_most(run, tmp_path, capsys):
    """A run whose data's buckets are here samples at its most common one (as its validation does); else
    the model's input size."""
    assert most_common_latent_shape(
        [{"latent_shape": [1, 8, 8], "num_samples": 3}, {"latent_shape": [1, 8, 16], "num_samples": 5}]
    ) == (1, 8, 16)
    write_feature_dataset(  # the digits model's 1 channel at 8 x 16 latents
        tmp_path / "wide", torch.zeros(2, 1, 8, 16), torch.zeros(2, 16, 64), torch.ones(2, 16, dtype=torch.int64)
    )
    config = load_config(run / "step-3" / "config.toml", [f"--data.path={tmp_path / 'wide'}"])
    (tmp_path / "wide.toml").write_text(config.to_toml())
    images = draw(run / "step-3", tmp_path / "out", "--config", str(tmp_path / "wide.toml"))
    assert "latents (1, 8, 16)" in capsys.readouterr().out and images.shape == (4, 32, 64)  # shown 4x enlarged
    draw(run / "step-3", tmp_path / "default")  # the digits: the model's input size, 8 x 8
    assert "latents (1, 8, 8)" in capsys.readouterr().out


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

    checkpoint, flags, out = run / "step-3", [], tmp_path / "samples"
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
