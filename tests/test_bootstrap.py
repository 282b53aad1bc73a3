"""tools/bootstrap.sh's decisions, without a network: which torch it installs or keeps, when it installs
with no index and from where, and what it says when an offline install cannot work.

Each test sources a copy of the script in a scratch project with a stand-in `python` on PATH: pip calls
are recorded instead of run, and the packages "installed" are fake distributions in a folder of its own
(Python runs without its site-packages, so only those are seen)."""

import inspect
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import packaging
import packaging.requirements

ROOT = Path(__file__).resolve().parents[1]
# what the GPU image of the device machines has of sana2's dependencies (tools/gpu_image_packages.txt)
IMAGE = {
    "transformers": "5.17.0",
    "einops": "0.8.1",
    "tensorboard": "2.20.0",
    "safetensors": "0.8.0",
    "pillow": "12.0.0",
    "tqdm": "4.67.1",
    "accelerate": "1.15.0",
    "peft": "0.18.0",  # the image has peft; its version is not recorded, and sana2 pins none
    "setuptools": "80.9.0",
    "pytest": "9.0.0",
    "pytest-timeout": "2.4.0",
}


def fake_distribution(site, name: str, version: str) -> None:
    """An "installed" package: its distribution's metadata and, for torch, a module with its version."""
    info = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if name == "torch":
        (Path(site) / "torch").mkdir()
        (Path(site) / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")


# pip's stand-in: records its arguments; "installing" torch makes it importable
FAKE_PIP = f"""
import json, os, re, sys
from pathlib import Path
with open(os.environ["PIP_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
{inspect.getsource(fake_distribution)}
for arg in sys.argv[1:]:
    match = re.fullmatch(r"torch(==(.+))?", arg)
    if match:
        fake_distribution(os.environ["FAKE_SITE"], "torch", match.group(2) or "2.15.0")
sys.exit(int(os.environ.get("FAKE_PIP_RC", "0")))
"""


def executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


class Scratch:
    """A copy of the project's bootstrap files, a fake virtual environment and a fake package set."""

    def __init__(self, tmp: Path, torch: str | None = None, installed: dict | None = None):
        self.project, self.venv, self.site = tmp / "project", tmp / "venv", tmp / "site"
        (self.project / "tools").mkdir(parents=True)
        shutil.copy(ROOT / "pyproject.toml", self.project)
        for name in ("bootstrap.sh", "offline_check.py"):
            shutil.copy(ROOT / "tools" / name, self.project / "tools")
        shutil.copytree(Path(packaging.__file__).parent, self.site / "packaging")  # versions are compared
        for name, version in {**({"torch": torch} if torch else {}), **(installed or {})}.items():
            fake_distribution(self.site, name, version)
        (tmp / "fake_pip.py").write_text(FAKE_PIP)
        executable(
            self.venv / "bin" / "python",
            "#!/bin/bash\n"
            f'[[ "$1" == -m && "$2" == pip ]] && {{ shift 2; exec {sys.executable} -S {tmp}/fake_pip.py "$@"; }}\n'
            f'PYTHONPATH={self.site} exec {sys.executable} -S "$@"\n',
        )
        self.bin = tmp / "bin"  # stand-ins for system tools (nvidia-smi)
        self.bin.mkdir()
        self.log = tmp / "pip.log"
        self.log.touch()

    def wheels(self, folder: Path, *names: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            (folder / f"{name}-py3-none-any.whl").touch()
        return folder

    def run(self, **env) -> subprocess.CompletedProcess:
        environment = {
            key: value for key, value in os.environ.items() if not key.startswith(("SANA2_", "PIP_", "VIRTUAL_ENV"))
        }
        environment.update(
            PATH=f"{self.venv / 'bin'}:{self.bin}:/usr/bin:/bin",
            VIRTUAL_ENV=str(self.venv),
            PIP_LOG=str(self.log),
            FAKE_SITE=str(self.site),
            **env,
        )
        return subprocess.run(
            ["bash", "-c", f"source {self.project}/tools/bootstrap.sh"],
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
        )

    def pip_calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def constraints(self) -> str:
        return (self.venv / ".sana2-constraints.txt").read_text().strip()


def test_a_cpu_machine_without_torch_gets_the_cpu_build_then_sana2_with_that_torch_pinned(tmp_path):
    scratch = Scratch(tmp_path)
    result = scratch.run()
    assert result.returncode == 0, result.stderr
    torch, sana2 = scratch.pip_calls()
    assert torch == ["install", "-q", "torch==2.13.0"]
    assert "--no-index" not in sana2 and sana2[-2:] == ["-e", f"{scratch.project}[test]"]
    assert sana2[sana2.index("-c") + 1] == str(scratch.venv / ".sana2-constraints.txt")
    assert scratch.constraints() == "torch==2.13.0"
    second = scratch.run()  # installed: nothing to do until pyproject.toml or the script changes
    assert second.returncode == 0 and len(scratch.pip_calls()) == 2


def test_a_gpu_machine_without_torch_gets_the_default_build(tmp_path):
    scratch = Scratch(tmp_path)
    executable(scratch.bin / "nvidia-smi", "#!/bin/bash\necho 'GPU 0: NVIDIA H200'\n")
    assert scratch.run().returncode == 0
    assert scratch.pip_calls()[0] == ["install", "-q", "torch"]


def test_an_importable_torch_is_never_reinstalled_or_upgraded(tmp_path):
    scratch = Scratch(tmp_path, torch="2.11.0+cu130")
    result = scratch.run()
    assert result.returncode == 0, result.stderr
    (sana2,) = scratch.pip_calls()  # no torch install
    assert "-c" in sana2 and scratch.constraints() == "torch==2.11.0+cu130"  # pip may not replace it


def test_a_wheelhouse_folder_means_offline_from_it_with_what_the_image_has(tmp_path):
    scratch = Scratch(tmp_path, torch="2.11.0+cu130", installed=IMAGE)
    wheelhouse = scratch.wheels(
        scratch.project / "wheelhouse", "diffusers-0.42.1", "importlib_metadata-10.2.0", "tyro-1.0.17"
    )
    result = scratch.run()
    assert result.returncode == 0, result.stderr
    assert f"offline, from {wheelhouse}" in result.stdout
    (sana2,) = scratch.pip_calls()
    assert sana2[:4] == ["install", "-q", "--no-index", "--find-links"] and sana2[4] == str(wheelhouse)
    assert "--no-build-isolation" in sana2  # the image's setuptools builds sana2: no index to fetch one from
    assert {"pytest", "pytest-timeout"} <= set(sana2)
    assert sana2[-2:] == ["-e", str(scratch.project)]  # no linters or codecs offline

    elsewhere = Scratch(tmp_path / "elsewhere", torch="2.11.0", installed=IMAGE)
    carried = elsewhere.wheels(tmp_path / "carried", "diffusers-0.42.1", "tyro-1.0.17")
    assert elsewhere.run(SANA2_WHEELHOUSE=str(carried)).returncode == 0
    assert elsewhere.pip_calls()[0][3:5] == ["--find-links", str(carried)]


def test_offline_names_every_missing_requirement_and_installs_nothing(tmp_path):
    image = {**IMAGE, "safetensors": "0.7.0"}
    del image["tqdm"], image["pytest-timeout"]
    scratch = Scratch(tmp_path, torch="2.11.0", installed=image)
    result = scratch.run(SANA2_OFFLINE="1")
    assert result.returncode != 0
    assert "missing: diffusers: not installed, and no wheelhouse" in result.stderr
    assert "missing: tqdm: not installed" in result.stderr
    assert "missing: safetensors>=0.8: 0.7.0 is installed" in result.stderr
    assert "pytest-timeout: not installed" in result.stderr and "./run_tests.sh will not run" in result.stderr
    assert "run tools/wheelhouse.sh" in result.stderr
    assert scratch.pip_calls() == []


def test_offline_without_an_importable_torch_says_so_unless_the_wheelhouse_has_one(tmp_path):
    scratch = Scratch(tmp_path, installed=IMAGE)
    wheelhouse = scratch.wheels(tmp_path / "wheelhouse", "diffusers-0.42.1", "tyro-1.0.17")
    result = scratch.run(SANA2_WHEELHOUSE=str(wheelhouse))
    assert result.returncode != 0 and scratch.pip_calls() == []
    assert f"torch is not importable here and {wheelhouse} has no torch wheel" in result.stderr

    scratch.wheels(wheelhouse, "torch-2.11.0")
    assert scratch.run(SANA2_WHEELHOUSE=str(wheelhouse)).returncode == 0
    torch = scratch.pip_calls()[0]
    assert torch == ["install", "-q", "--no-index", "--find-links", str(wheelhouse), "torch"]


def test_a_failed_offline_install_is_explained_and_leaves_no_stamp(tmp_path):
    scratch = Scratch(tmp_path, torch="2.11.0", installed=IMAGE)
    wheelhouse = scratch.wheels(tmp_path / "wheelhouse", "diffusers-0.42.1", "tyro-1.0.17")
    result = scratch.run(SANA2_WHEELHOUSE=str(wheelhouse), FAKE_PIP_RC="1")
    assert result.returncode != 0
    assert (
        f"pip could not install sana2 without an index (its message above names what it did not find in {wheelhouse})"
        in (result.stderr)
    )
    assert not (scratch.venv / ".sana2-installed").exists()  # the next run tries again


def test_optional_packages_are_extras_that_an_offline_install_does_without(tmp_path):
    """PyAV and wandb (not on the GPU image, IMAGE) are extras: the tests install them online, an offline
    install from the image and a wheelhouse of the required packages alone needs neither."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {packaging.requirements.Requirement(r).name for r in project["dependencies"]}
    optional = project["optional-dependencies"]
    assert optional["wandb"] == ["wandb"] and optional["video"] == ["av"]
    assert {"av", "wandb"} <= set(optional["test"]) and not {"av", "wandb"} & (required | set(IMAGE))
    scratch = Scratch(tmp_path, torch="2.11.0+cu130", installed=IMAGE)
    scratch.wheels(scratch.project / "wheelhouse", "diffusers-0.42.1", "importlib_metadata-10.2.0", "tyro-1.0.17")
    result = scratch.run()
    assert result.returncode == 0 and "missing" not in result.stderr, result.stderr


def test_a_wheelhouse_that_is_not_a_folder_is_an_error(tmp_path):
    scratch = Scratch(tmp_path, torch="2.11.0")
    result = scratch.run(SANA2_WHEELHOUSE=str(tmp_path / "nowhere"))
    assert result.returncode == 2 and "is not a folder" in result.stderr and scratch.pip_calls() == []
