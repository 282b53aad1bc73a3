#!/usr/bin/env bash
# Make a Python environment that runs sana2, once: `source tools/bootstrap.sh`. Sourced by
# run_train.sh, run_tests.sh and benchmarks/gpu_check.sh.
#
# Uses the active virtual environment if there is one, else creates ./.venv. Where `python3` already
# imports torch (a cluster's or a GPU image's own build), the new .venv sees that interpreter's
# packages (a .pth file naming its site-packages) and uses them: an importable torch is never
# reinstalled or upgraded (pip runs with it pinned). Without an importable torch it installs one:
# where no NVIDIA GPU is present torch==2.13.0 (this project's CPU machines serve a CPU-build wheel of
# it; elsewhere set PIP_INDEX_URL to a CPU index, or SANA2_CPU_TORCH_VERSION), else the default
# (CUDA) build; a plain `pip install torch` would pull a multi-GB CUDA build onto a CPU machine.
#
# Offline (a compute node without internet): when ./wheelhouse exists, SANA2_WHEELHOUSE names a
# folder, or SANA2_OFFLINE=1, pip installs with no index, from that folder and what is installed.
# tools/wheelhouse.sh fills such a folder on a machine with registry access. What neither has is
# named before pip starts (tools/offline_check.py), and nothing is installed then.
_sana2_bootstrap() {
    local root wheelhouse="" offline=0
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    if [[ -n "${SANA2_WHEELHOUSE:-}" ]]; then
        if [[ ! -d "$SANA2_WHEELHOUSE" ]]; then
            echo "[bootstrap] SANA2_WHEELHOUSE=$SANA2_WHEELHOUSE is not a folder (expected tools/wheelhouse.sh's output)" >&2
            return 2
        fi
        wheelhouse="$(cd "$SANA2_WHEELHOUSE" && pwd)"
    elif [[ -d "$root/wheelhouse" ]]; then
        wheelhouse="$root/wheelhouse"
    fi
    if [[ -n "$wheelhouse" || "${SANA2_OFFLINE:-0}" == 1 ]]; then
        offline=1
    fi

    if [[ -z "${VIRTUAL_ENV:-}" ]]; then
        if [[ ! -x "$root/.venv/bin/python" ]]; then
            if python3 -c "import torch" 2>/dev/null; then
                # no pip or setuptools of its own: those of python3's packages serve (and install into .venv)
                python3 -m venv --without-pip "$root/.venv" || return 1
                _sana2_see_site_packages python3 "$root/.venv/bin/python" || return 1
                "$root/.venv/bin/python" -c "import pip" 2>/dev/null || "$root/.venv/bin/python" -m ensurepip -q || return 1
            else
                python3 -m venv "$root/.venv" || return 1
            fi
        fi
        # shellcheck disable=SC1091
        source "$root/.venv/bin/activate"
    fi
    local stamp="$VIRTUAL_ENV/.sana2-installed" want
    want="$(cat "$root/pyproject.toml" "$root/tools/bootstrap.sh" | sha256sum | cut -d' ' -f1)"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi

    local index=() constraints="$VIRTUAL_ENV/.sana2-constraints.txt"
    if ((offline)); then
        index=(--no-index)
        [[ -n "$wheelhouse" ]] && index+=(--find-links "$wheelhouse")
        echo "[bootstrap] installing sana2 into $VIRTUAL_ENV offline, from ${wheelhouse:-what is installed}"
    else
        echo "[bootstrap] installing sana2 and its dependencies into $VIRTUAL_ENV"
    fi
    if ! python -c "import torch" 2>/dev/null; then
        if ((offline)); then
            if ! compgen -G "${wheelhouse:-/nonexistent}/torch-*.whl" >/dev/null; then
                echo "[bootstrap] missing: torch is not importable here and ${wheelhouse:-no wheelhouse} has no torch wheel." \
                    "Load or install the site's torch build (sana2 needs torch>=2.11), or put a torch wheel in the wheelhouse" >&2
                return 1
            fi
            python -m pip install -q "${index[@]}" torch || return 1
        elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            python -m pip install -q torch || return 1
        else
            python -m pip install -q "torch==${SANA2_CPU_TORCH_VERSION:-2.13.0}" || return 1
        fi
    fi
    # the torch now importable stays: whatever sana2's dependencies ask, pip may not replace it
    python -c "import torch; print('torch==' + torch.__version__)" >"$constraints" || return 1
    local target=("$root[test]") extra=()
    if ((offline)); then
        local args
        args="$(python "$root/tools/offline_check.py" "$root" "$wheelhouse")" || return 1
        read -ra extra <<<"$args"
        target=("$root")  # the linters and codecs of [test] are not needed to train
    fi
    if ! python -m pip install -q "${index[@]}" -c "$constraints" "${extra[@]}" -e "${target[@]}"; then
        if ((offline)); then
            echo "[bootstrap] pip could not install sana2 without an index (its message above names what it did not" \
                "find in ${wheelhouse:-the installed packages}); tools/wheelhouse.sh collects what is missing" >&2
        fi
        return 1
    fi
    echo "$want" >"$stamp"
}

# Make the virtual environment of `venv_python` see the packages of `python`: a .pth file in the
# venv's site-packages lists the other's site-packages folders (after the venv's own on sys.path).
_sana2_see_site_packages() {
    local python=$1 venv_python=$2 site
    site="$("$venv_python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" || return 1
    "$python" -c "import os, sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages')) and os.path.isdir(p)))" \
        >"$site/_sana2_site_packages.pth" || return 1
    echo "[bootstrap] the new environment uses the packages of $(command -v "$python") (torch among them): $site/_sana2_site_packages.pth"
}

_sana2_bootstrap || { _sana2_status=$?; unset -f _sana2_bootstrap _sana2_see_site_packages; return $_sana2_status 2>/dev/null || exit $_sana2_status; }
unset -f _sana2_bootstrap _sana2_see_site_packages
