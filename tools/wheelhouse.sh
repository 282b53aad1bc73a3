#!/usr/bin/env bash
# Collect the wheels sana2 needs that a target environment lacks into one folder, on a machine with
# registry access, for a compute node without internet: carry the folder there as ./wheelhouse (or
# point SANA2_WHEELHOUSE at it) and tools/bootstrap.sh installs from it with no index.
#
#   tools/wheelhouse.sh [FOLDER]        (default ./wheelhouse; it must not exist yet)
#
# SANA2_IMAGE_PACKAGES  what the target has: a file of `name` or `name==version` lines, e.g. the output
#                       of `python3 -m pip freeze` there (default tools/gpu_image_packages.txt: the GPU
#                       image of this project's device machines, with torch 2.11 and Python 3.12). Every
#                       name in it is left out of the folder; the pinned ones hold their versions while
#                       the rest is resolved, so what is collected works with what is there.
# SANA2_WHEELHOUSE_PYTHON    the target's Python version (default 3.12)
# SANA2_WHEELHOUSE_PLATFORM  its platform tags, space-separated (default: manylinux x86-64, glibc 2.17-2.28)
# SANA2_WHEELHOUSE_EXTRAS    sana2's extras to collect too, comma-separated: "video" (PyAV, 35 MB), "wandb"
#                            (Weights & Biases, [metrics] enable_wandb), "test"
#
# Collected: sana2's dependencies, its build backend and the test runner (pytest, pytest-timeout),
# with everything they need, less what the target has. Nothing is installed here.
# Needs Python 3.11+ (tomllib) and pip here.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
folder=${1:-$root/wheelhouse}
have=${SANA2_IMAGE_PACKAGES:-$root/tools/gpu_image_packages.txt}
if [[ -e "$folder" ]]; then
    echo "wheelhouse: $folder exists; give a new folder (this script never changes an existing one)" >&2
    exit 2
fi
if [[ ! -f "$have" ]]; then
    echo "wheelhouse: SANA2_IMAGE_PACKAGES=$have is not a file (expected \`pip freeze\` lines)" >&2
    exit 2
fi
target=(--only-binary=:all: --implementation cp --python-version "${SANA2_WHEELHOUSE_PYTHON:-3.12}")
for tag in ${SANA2_WHEELHOUSE_PLATFORM:-manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}; do
    target+=(--platform "$tag")
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# what to resolve (sana2's requirements the target lacks) and what to hold (the target's pins)
python3 - "$root/pyproject.toml" "$have" "${SANA2_WHEELHOUSE_EXTRAS:-}" "$work" <<'PY'
import re, sys, tomllib
from pathlib import Path

project_file, have_file, extras, work = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
name_of = lambda text: norm(re.split(r"[\s\[<>=!~;]", text.strip(), maxsplit=1)[0])
project = tomllib.loads(Path(project_file).read_text())
wanted = [*project["build-system"]["requires"], *project["project"]["dependencies"], "pytest", "pytest-timeout"]
optional = project["project"]["optional-dependencies"]
for extra in filter(None, extras.split(",")):
    if extra not in optional:
        sys.exit(f"wheelhouse: sana2 has no extra {extra!r} (it has {', '.join(sorted(optional))})")
    wanted += optional[extra]
lines = [line.split("#")[0].strip() for line in Path(have_file).read_text().splitlines()]
have = {name_of(line): line for line in lines if line}
missing = [text for text in dict.fromkeys(wanted) if name_of(text) not in have]
Path(work, "wanted.txt").write_text("\n".join(missing) + "\n")
Path(work, "pins.txt").write_text("\n".join(line for line in have.values() if "==" in line) + "\n")
Path(work, "have.txt").write_text("\n".join(have) + "\n")
print("wheelhouse: the target lacks", ", ".join(missing) if missing else "nothing sana2 needs")
PY
if ! grep -q . "$work/wanted.txt"; then
    mkdir -p "$folder"
    echo "wheelhouse: nothing to collect; $folder is empty"
    exit 0
fi

# resolve them for the target, with what it has held at its versions: pip download fetches every wheel
# the resolution needs (pip install --dry-run would check Requires-Python against this machine's Python)
python3 -m pip download -q "${target[@]}" -d "$work/resolved" -c "$work/pins.txt" -r "$work/wanted.txt"
mkdir -p "$folder"
for wheel in "$work"/resolved/*.whl; do
    name="$(basename "$wheel" | cut -d- -f1 | tr '_.' '--' | tr '[:upper:]' '[:lower:]')"
    grep -qxF "$name" "$work/have.txt" || cp "$wheel" "$folder/"
done
echo "wheelhouse: $(ls "$folder" | wc -l) wheels, $(du -sh "$folder" | cut -f1) in $folder:"
ls -s --block-size=K "$folder" | tail -n +2
