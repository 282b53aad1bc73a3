"""Time and peak memory of sana2-convert vs torch's dcp_to_torch_save on a real-size checkpoint.

    OMP_NUM_THREADS=1 python benchmarks/bench_convert.py --models SanaMS_600M_P1_D28 [SanaMS_1600M_P1_D20]

For each model: build it on the meta device for its key/shape set, write a synthetic DCP
checkpoint of random fp32 weights (model only, one process, one tensor at a time) into a
temporary folder, then run each conversion in its own subprocess and report its wall time and
peak RSS. The checkpoint is read once before each conversion so all start from a warm page cache.

sana2-convert flushes its outputs to disk (fsync) before renaming them into place, so that a crash
never leaves a file that looks complete; dcp_to_torch_save leaves its file in the page cache. The
"+ fsync" row adds that flush to torch's conversion, for a like-for-like time.

Peak RSS is the child's own ru_maxrss from os.wait4 (RUSAGE_CHILDREN would be the maximum over
all children so far). Linux carries a process's RSS high-water mark across fork and exec, so
the parent never imports torch or touches tensors: writing the checkpoint happens in a child too.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sana2.staging import human_bytes  # noqa: E402  (torch-free)

CONVERTER = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "{ckpt}"]
# id -> (label, command); {ckpt} is the DCP step folder, {out} an empty output folder
CONVERSIONS = {
    "pth": ("sana2 --format pth", CONVERTER + ["{out}/model.pth", "--format", "pth"]),
    "safetensors": ("sana2 --format safetensors", CONVERTER + ["{out}/model.safetensors", "--format", "safetensors"]),
    "accelerate": ("sana2 --format accelerate (.bin + .pth)", CONVERTER + ["{out}/accelerate"]),
    "diffusers": ("sana2 --format diffusers", CONVERTER + ["{out}/diffusers", "--format", "diffusers"]),
    "pth-bf16": (
        "sana2 --format pth --dtype bf16",
        CONVERTER + ["{out}/model.pth", "--format", "pth", "--dtype", "bf16"],
    ),
    "pth-verify": ("sana2 --format pth --verify", CONVERTER + ["{out}/model.pth", "--format", "pth", "--verify"]),
    "dcp_to_torch_save": (
        "torch dcp_to_torch_save",
        [
            sys.executable,
            "-c",
            "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])",
            "{ckpt}",
            "{out}/model.pt",
        ],
    ),
    "dcp_to_torch_save_fsync": (
        "torch dcp_to_torch_save + fsync",
        [
            sys.executable,
            "-c",
            "import os, sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
            "dcp_to_torch_save(sys.argv[1], sys.argv[2]); os.fsync(os.open(sys.argv[2], os.O_RDONLY))",
            "{ckpt}",
            "{out}/model.pt",
        ],
    ),
}


def write_synthetic_checkpoint(name: str, folder: Path) -> dict:
    """(Runs in a child.) The model's keys and shapes with random fp32 values, as a DCP step folder."""
    import torch

    from sana2.formats.tensors import SourceTensor
    from sana2.models import build_model
    from sana2.tools.dcp_import import write_dcp

    with torch.device("meta"):
        shapes = {key: tuple(value.shape) for key, value in build_model(name).state_dict().items()}

    def random_values(out, start, seed):
        out.copy_(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)))

    tensors = [
        SourceTensor(key, shape, torch.float32, lambda out, start, seed=index: random_values(out, start, seed))
        for index, (key, shape) in enumerate(shapes.items())
    ]
    sizes = [torch.Size(shape).numel() * 4 for shape in shapes.values()]
    free = shutil.disk_usage(folder.parent if folder.parent.exists() else tempfile.gettempdir()).free
    if free < 3 * sum(sizes):  # the checkpoint, an output, and the next output before the last is deleted
        return {"skipped": f"needs {human_bytes(3 * sum(sizes))} of free disk, {human_bytes(free)} available"}
    started = time.monotonic()
    write_dcp(tensors, folder, {"converted_from": "synthetic", "model": {"name": name}})  # the model: for diffusers
    return {"tensors": len(sizes), "bytes": sum(sizes), "largest": max(sizes), "seconds": time.monotonic() - started}


def settle(folder: Path) -> None:
    """Same start for every conversion: the checkpoint in the page cache, no dirty pages left to write back."""
    for path in folder.iterdir():
        with open(path, "rb") as file:
            while file.read(64 << 20):
                pass
    os.sync()


def run_measured(command: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS bytes and stdout of one child process."""
    with tempfile.TemporaryFile() as stderr:
        started = time.monotonic()
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        stdout = child.stdout.read()  # to EOF, without reaping the child: wait4 does that
        _, status, usage = os.wait4(child.pid, 0)
        elapsed = time.monotonic() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed:\n{stderr.read().decode()}")
    return elapsed, usage.ru_maxrss * 1024, stdout.decode()


def bench_model(name: str, workdir: Path, conversions: list[str], repeats: int) -> list[tuple]:
    checkpoint = workdir / name / "checkpoint" / "step-0"
    checkpoint.parent.mkdir(parents=True)
    _, _, report = run_measured([sys.executable, __file__, "--write-checkpoint", name, str(checkpoint)])
    info = json.loads(report.splitlines()[-1])
    if "skipped" in info:
        print(f"skipping {name}: {info['skipped']}")
        return []
    print(
        f"{name}: {info['tensors']} tensors, {human_bytes(info['bytes'])} fp32 (largest "
        f"{human_bytes(info['largest'])}); synthetic DCP checkpoint written in {info['seconds']:.1f} s",
        flush=True,
    )
    rows = []
    for conversion in conversions:
        label, template = CONVERSIONS[conversion]
        runs = []
        for _ in range(repeats):
            out = workdir / name / "out"
            out.mkdir()
            settle(checkpoint)
            runs.append(run_measured([part.format(ckpt=checkpoint, out=out) for part in template])[:2])
            shutil.rmtree(out)
        seconds, peak = min(run[0] for run in runs), max(run[1] for run in runs)
        rows.append((name, label, seconds, peak, info["bytes"]))
        times = ", ".join(f"{run[0]:.1f}" for run in runs)
        print(f"  {label:<42} {times} s  peak RSS {human_bytes(peak)}", flush=True)
    shutil.rmtree(workdir / name)
    return rows


def print_table(rows: list[tuple]) -> None:
    print()
    print("| model | conversion | wall s (best) | GB/s | peak RSS |")
    print("|---|---|---|---|---|")
    for name, label, seconds, peak, total in rows:
        print(f"| {name} | {label} | {seconds:.1f} | {total / seconds / 1e9:.2f} | {human_bytes(peak)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["SanaMS_600M_P1_D28"])
    parser.add_argument("--conversions", nargs="+", default=list(CONVERSIONS), choices=list(CONVERSIONS))
    parser.add_argument("--repeats", type=int, default=2, help="runs per conversion (the table shows the fastest)")
    parser.add_argument("--workdir", help="where to write the checkpoints (default: the system temporary folder)")
    parser.add_argument("--write-checkpoint", nargs=2, metavar=("MODEL", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        name, folder = args.write_checkpoint
        print(json.dumps(write_synthetic_checkpoint(name, Path(folder))))
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_convert_") as workdir:
        for name in args.models:
            rows += bench_model(name, Path(workdir), args.conversions, args.repeats)
    print_table(rows)


if __name__ == "__main__":
    main()
