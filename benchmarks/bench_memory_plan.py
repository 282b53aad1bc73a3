"""The memory plan against measurement: predicted per-rank peak vs the peak RSS of real training on CPU.

    python benchmarks/bench_memory_plan.py                  # debug model at 1, 2, 4 ranks; 600M at 1, 2
    python benchmarks/bench_memory_plan.py --only debug
    python benchmarks/bench_memory_plan.py --only 600m      # ~15 GB: run alone, under the heavy-job lock
    python benchmarks/bench_memory_plan.py --markdown benchmarks/results/memory_plan.md
    python benchmarks/bench_memory_plan.py --only accumulation   # 600M at 256px, 2 micro-batches, 4 ranks

Each row trains the config under torchrun for a few steps (sana2.train's Trainer, gloo) and takes the
largest peak RSS over the ranks; the plan (`python -m sana2.plan ... --device cpu`) predicts it from
the config alone. On CPU the peak includes the process runtime (Python, torch, gloo, data), which the
plan models as a measured constant per world size (benchmarks/calibrate_activations.py).

Two allocators. By default glibc's malloc raises its mmap threshold each time it frees a large
block, after which freed tensors stay in its heap: RSS then keeps a slack that depends on the order
of allocations, like CUDA's reserved-but-unallocated memory. The plan predicts live tensors plus
runtime (what `torch.cuda.max_memory_allocated` measures on a GPU), so the first measured column pins
the threshold (MALLOC_MMAP_THRESHOLD_=131072: freed blocks above 128 KiB go back to the system) and
the last shows plain glibc for comparison.

`--only accumulation` checks gradient accumulation, where FSDP2 holds every unit's unsharded gradient
between micro-batches and frees each as the last micro-batch reduce-scatters it: rank 0 of 4 trains
in this process over a fake process group (sana2/planning/measure.py), its live tensor bytes counted,
against the plan without the runtime (live tensors only).
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30
COMMON = ["--validation.enable=false", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false"]
# glibc malloc: return freed blocks above 128 KiB to the system instead of keeping them in the heap
PINNED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def worker(args) -> None:
    import torch.distributed as dist

    from sana2.components.stats import memory_stats
    from sana2.config import load_config
    from sana2.train import Trainer

    trainer = Trainer(load_config(args.config, args.overrides))
    for _ in range(args.steps):
        trainer.train_step()
    peak = memory_stats(trainer.device).get("memory/peak_rss_gib", 0.0) * GIB
    peaks = [None] * trainer.world_size
    dist.all_gather_object(peaks, peak)
    if trainer.rank == 0:
        Path(args.out).write_text(json.dumps({"peaks": peaks}))
    del trainer
    gc.collect()  # free FSDP state before the process group (as sana2.train.main does)
    dist.destroy_process_group()


def measure_training_peak(
    config: str | None, overrides: list[str], world_size: int, steps: int, workdir: Path, env: dict | None = None
) -> int:
    """The largest peak RSS over the ranks of a `steps`-step training run under torchrun, in bytes;
    `env`: extra environment (PINNED_MMAP_THRESHOLD is the plan's reference)."""
    out = workdir / f"peaks_{world_size}_{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd += [__file__, "--worker", "--steps", str(steps), "--out", str(out)]
    cmd += (["--config", config] if config else []) + ["--", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
    return int(max(json.loads(out.read_text())["peaks"]))


def planned(config: str | None, overrides: list[str], world_size: int, calibration: dict | None = None):
    """The plan for the same run on CPU (this process has no process group, as the dry run needs)."""
    from sana2.config import load_config
    from sana2.plan import make_memory_plan

    return make_memory_plan(load_config(config, overrides), world_size, device="cpu", calibration=calibration)


def row(label: str, config: str | None, overrides: list[str], world_size: int, steps: int, workdir: Path) -> dict:
    plan = planned(config, overrides, world_size)
    measured = measure_training_peak(config, overrides, world_size, steps, workdir, PINNED_MMAP_THRESHOLD)
    default = measure_training_peak(config, overrides, world_size, steps, workdir)
    e = plan.estimate
    return {
        "label": label,
        "world_size": world_size,
        "local_batch": e.setup.local_batch,
        "predicted": e.peak,
        "runtime": e.setup.runtime_bytes,
        "moment": e.peak_moment.name,
        "measured": measured,
        "error": (e.peak - measured) / measured,
        "default": default,
        "default_error": (e.peak - default) / default,
    }


def accumulation_row(workdir: Path) -> str:
    """SanaMS_600M_P1_D28 at 256px, fp32, local batch 1 x 2 micro-batches on rank 0 of 4: the planned and the
    measured peak of live tensor bytes."""
    from sana2.config import load_config
    from sana2.planning.activations import load_calibration
    from sana2.planning.measure import measure_fsdp_steps

    overrides = [
        *COMMON,
        f"--job.dump_folder={workdir}/accumulation",
        "--model.name=SanaMS_600M_P1_D28",
        "--model.input_size=8",
        "--model.model_max_length=300",
        "--training.local_batch_size=1",
        "--training.gradient_accumulation_steps=2",
        "--training.mixed_precision_param=float32",
    ]
    config = str(ROOT / "train_configs/debug_model.toml")
    tensors_only = {**load_calibration(), "cpu_runtime_bytes": {"1": 0}}
    plan = planned(config, overrides, 4, tensors_only).estimate
    measured = measure_fsdp_steps(load_config(config, overrides), 4, steps=2).peak
    return (
        "| model | ranks | micro-batches | predicted live GiB | measured live GiB | error | predicted peak moment |\n"
        "|---|---:|---:|---:|---:|---:|---|\n"
        f"| SanaMS_600M_P1_D28 at 256px, fp32, AdamW + EMA | 4 | 2 | {plan.peak / GIB:.3f} | {measured / GIB:.3f} | "
        f"{(plan.peak - measured) / measured:+.1%} | {plan.peak_moment.name} |"
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| model | ranks | local batch | predicted peak GiB | of which runtime | measured peak RSS GiB | error "
        "| RSS, glibc defaults | error | predicted peak moment |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['world_size']} | {r['local_batch']} | {r['predicted'] / GIB:.3f} | "
            f"{r['runtime'] / GIB:.3f} | {r['measured'] / GIB:.3f} | {r['error']:+.1%} | {r['default'] / GIB:.3f} | "
            f"{r['default_error']:+.1%} | {r['moment']} |"
        )
    return "\n".join(lines)


MARKDOWN_HEAD = "command: `python "


def write_markdown(path: Path, table: str) -> None:
    """The result table under the command that made it; replaces only a benchmark's own earlier table."""
    if path.exists() and not path.read_text(errors="replace").startswith(MARKDOWN_HEAD):
        print(
            f"--markdown {path}: not a table a benchmark wrote; refusing to overwrite it (choose another file)",
            file=sys.stderr,
        )
        sys.exit(2)  # bad input, as every sana2 command
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"command: `{' '.join(['python', *sys.argv])}`\n\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out")
    parser.add_argument("--only", choices=["debug", "600m", "accumulation"])
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows = []
    debug_config = str(ROOT / "train_configs/debug_model.toml")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.only == "accumulation":
            print(accumulation_row(workdir))
            return
        if args.only in (None, "debug"):
            debug = [*COMMON, f"--job.dump_folder={workdir}/debug", "--training.global_batch_size=64"]
            measure_training_peak(debug_config, debug, 1, 1, workdir)  # builds the digits cache outside the runs
            for n in (1, 2, 4):
                rows.append(row("SanaMS_digits (debug config), fp32", debug_config, debug, n, 4, workdir))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        if args.only in (None, "600m"):
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from bench_train import synthetic_features

            big = [
                *COMMON,
                f"--job.dump_folder={workdir}/600m",
                "--model.name=SanaMS_600M_P1_D28",
                "--model.input_size=16",
                f"--data.path={synthetic_features(workdir, 8)}",
                "--model.model_max_length=300",
                "--training.global_batch_size=2",
                "--training.mixed_precision_param=float32",
                "--lr_scheduler.warmup_steps=0",
            ]
            for n in (1, 2):
                rows.append(row("SanaMS_600M_P1_D28 at 512px, fp32, AdamW + EMA", debug_config, big, n, 3, workdir))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    if args.markdown:
        write_markdown(Path(args.markdown), table(rows))


if __name__ == "__main__":
    main()
