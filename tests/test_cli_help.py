"""The command line explains itself: `--help` of the trainer and the launcher, and the presets a pip install ships."""

import dataclasses
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sana2.cli import dtype_name, torch_dtype
from sana2.config import PRESETS, _sections, load_config
from sana2.models.config import SanaConfig

REPO = Path(__file__).resolve().parents[1]


def run(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.slow
def test_train_help_lists_every_config_key_with_its_type_default_and_docstring():
    result = run("-m", "sana2.train", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "python -m sana2.train CONFIG [--section.key=value ...]" in text
    for section, cls in _sections().items():
        fields = dataclasses.fields(SanaConfig) if section == "model" else dataclasses.fields(cls)
        for f in fields:
            # (a table's entries are listed as --section.key.entry)
            assert re.search(rf"--{section}\.{f.name}[ .]", text), f"{section}.{f.name} missing from --help"
    assert "--model.name STR" in text and "--training.caption_dropout FLOAT" in text
    assert "--encoding.dtype {float32,bfloat16,float16}" in text  # a Literal's choices
    flat = " ".join(text.split())  # help lines wrap at the terminal's width
    assert "Caption tokens: the text encoder pads or cuts every caption" in flat  # a field's docstring
    assert "(classifier-free guidance), in [0, 1). (default: 0.1)" in flat  # its default
    assert "(default: SanaMS_digits)" in flat
    for preset in PRESETS:
        assert preset in text


@pytest.mark.slow
def test_launch_help_leads_with_sana2s_usage_then_torchruns_options():
    result = run("-m", "sana2.launch", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    usage = text.index("usage: python -m sana2.launch [torchrun options] -m sana2.train CONFIG")
    assert usage == 0 and text.index("python -m sana2.train --help") < text.index("--nproc-per-node")


def test_a_preset_is_found_by_name_from_any_directory(tmp_path):
    by_name = load_config("sana_600m_img512")
    assert by_name.to_dict() == load_config(REPO / "train_configs" / "sana_600m_img512.toml").to_dict()
    assert load_config("debug_model.toml").model.name == "SanaMS_digits"
    result = run("-m", "sana2.config", "debug_model", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def test_dtype_names_take_every_spelling():
    assert {dtype_name(s) for s in ("bf16", "bfloat16", "BF16")} == {"bfloat16"}
    assert dtype_name("fp32") == "float32" and dtype_name("fp16") == "float16"
    assert dtype_name("int8") == "int8"  # unknown: left for the caller's choices to name
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


@pytest.mark.slow
def test_the_wheel_ships_the_presets(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("sana2-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"sana2/train_configs/{name}.toml" for name in PRESETS} <= names
    assert (
        "sana2-train = sana2.train:worker_main"
        in zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
