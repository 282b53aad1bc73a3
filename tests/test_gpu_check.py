"""benchmarks/gpu_check.sh in its CPU smoke mode: every step the GPU check takes runs and reports, up to the
CUDA-specific parts (NCCL, CUDA memory statistics, MFU), so the script is known to work before a GPU runs it."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_smoke_mode_runs_every_step_and_reports_against_the_plan(tmp_path):
    result = subprocess.run(
        [str(ROOT / "benchmarks/gpu_check.sh")],
        env={**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path / "gpu_check")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    lines = {line.split(":")[0]: line for line in out.splitlines() if ":" in line}
    runs = ("debug", "sana_1600m_1024px", "sana_video_2000m_480p", "sana_1600m_1024px_cpu_offload")
    for run in (*runs, "sana_video_2000m_480p_clips"):
        line = lines[run]
        for field in ("step ", "tokens/s ", "peak RSS ", "(plan "):
            assert field in line, line
    assert "validation loss" in lines["debug"]
    assert "checkpoint save: checkpoint step 4: training blocked" in out
    assert "checkpoint load: resumed at step 4 and trained to step 6" in out
    assert "latents 16x3x4x4" in out  # the video run read video-shaped latents
    assert "clips: 2 synthetic 9-frame 48x32 clips at 16 fps, Wan 2.1 VAE" in out  # the video run from clips
    assert "gpu_check passed" in out
