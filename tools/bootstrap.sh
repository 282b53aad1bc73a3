#!/usr/bin/env bash
# Make a Python environment that runs sana2, once: `source tools/bootstrap.sh`.
# Uses the active virtual environment if there is one, else creates ./.venv. Where no NVIDIA GPU is
# present it installs torch==2.13.0, which this project's CPU machines serve as a local CPU-build
# wheel (elsewhere set PIP_INDEX_URL to a CPU index, or SANA2_CPU_TORCH_VERSION); a plain
# `pip install torch` would pull a multi-GB CUDA build. Sourced by run_train.sh and run_tests.sh.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
    if [[ ! -x "$root/.venv/bin/python" ]]; then
        python3 -m venv "$root/.venv"
    fi
    # shellcheck disable=SC1091
    source "$root/.venv/bin/activate"
fi
stamp="$VIRTUAL_ENV/.sana2-installed"
want="$(cat "$root/pyproject.toml" "$root/tools/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "[bootstrap] installing sana2 and its dependencies into $VIRTUAL_ENV"
    if ! python -c "import torch" 2>/dev/null; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            python -m pip install -q torch
        else
            python -m pip install -q "torch==${SANA2_CPU_TORCH_VERSION:-2.13.0}"
        fi
    fi
    python -m pip install -q -e "$root[test]"
    echo "$want" > "$stamp"
fi
