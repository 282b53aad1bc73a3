"""Training throughput and per-rank peak memory at world sizes 1, 2, 4 (debug model) and for
SanaMS_600M at 512px on 1 and 2 ranks, against the physical minimum of 16 bytes x params / N
(fp32 params + grads + two AdamW moments).

    python benchmarks/bench_train.py                  # everything
    python benchmarks/bench_train.py --only debug     # debug model only
    python benchmarks/bench_train.py --only 600m

Each configuration runs under torchrun; every rank reports its peak RSS (CPU) or max allocated
(CUDA) after the timed steps.
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

GIB = 2**30


def worker(args) -> None:
    import torch.distributed as dist

    from sana2.components.stats import memory_stats
    from sana2.config import load_config
    from sana2.train import Trainer

    trainer = Trainer(load_config(args.config, args.overrides))
    for _ in range(args.warmup):
        trainer.train_step()
    dist.barrier()
    start = time.perf_counter()
    samples = 0.0
    for _ in range(args.steps):
        samples += trainer.train_step().samples
    dist.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    memory = memory_stats(trainer.device)
    peak = memory.get("memory/peak_rss_gib", memory.get("memory/max_allocated_gib"))
    peaks = [None] * trainer.world_size
    dist.all_gather_object(peaks, peak)
    checkpoint_bytes = None
    if args.save:  # after the peak was read: a save's staging is not training memory
        trainer.save_checkpoint(final=True)
        step_folder = trainer.checkpointer.final_path(trainer.step)
        checkpoint_bytes = sum(f.stat().st_size for f in step_folder.rglob("*") if f.is_file())
    if trainer.rank == 0:
        params = sum(p.numel() for p in trainer.model.parameters())
        result = {
            "checkpoint_bytes": checkpoint_bytes,
            "world_size": trainer.world_size,
            "params": params,
            "step_seconds": seconds,
            "samples_per_second": samples / args.steps / seconds,
            "peak_gib_per_rank": peaks,
            "adamw_minimum_gib_per_rank": 16 * params / trainer.world_size / GIB,
        }
        Path(args.out).write_text(json.dumps(result))
    del trainer
    gc.collect()  # free FSDP state before the process group, or the exit can abort (as in sana2.train.main)
    dist.destroy_process_group()


def synthetic_features(root: Path, samples: int) -> Path:
    """Random DC-AE-shaped latents (32 x 16 x 16) and Gemma-shaped captions (300 x 2304)."""
    import torch

    from sana2.data.writer import write_feature_dataset

    path = root / "features_512"
    if not path.exists():
        generator = torch.Generator().manual_seed(0)
        mask = torch.zeros(samples, 300, dtype=torch.int64)
        mask[:, :120] = 1
        write_feature_dataset(
            path,
            torch.randn(samples, 32, 16, 16, generator=generator),
            torch.randn(samples, 300, 2304, generator=generator).to(torch.bfloat16),
            mask,
        )
    return path


def run(
    world_size: int,
    config: str,
    overrides: list[str],
    steps: int,
    warmup: int,
    workdir: Path,
    label: str = "",
    save: bool = False,
    env: dict | None = None,
) -> dict:
    """One torchrun run of `worker`; `save`: then a final checkpoint, whose bytes on disk it reports."""
    out = workdir / f"result_{world_size}_{time.time_ns()}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world_size),
        __file__,
        "--worker",
        "--config",
        config,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(out),
        *(["--save"] if save else []),
        "--",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return {**json.loads(out.read_text()), "label": label}


def report(name: str, results: list[dict]) -> None:
    base = results[0]["step_seconds"]
    print(f"\n{name}  ({results[0]['params']:,} parameters)")
    print(
        f"{'world':>5} {'':>8} {'step s':>8} {'vs 1 proc':>9} {'samples/s':>10} {'peak GiB per rank':>24} "
        f"{'16B x P / N GiB':>16}"
    )
    for r in results:
        peaks = " ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(
            f"{r['world_size']:>5} {r['label']:>8} {r['step_seconds']:>8.3f} {r['step_seconds'] / base:>8.2f}x "
            f"{r['samples_per_second']:>10.1f} {peaks:>24} {r['adamw_minimum_gib_per_rank']:>16.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("--save", action="store_true", help="worker: save a final checkpoint after the timed steps")
    parser.add_argument("--only", choices=["debug", "600m"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    root = Path(__file__).resolve().parents[1]
    common = ["--validation.enable=false", "--checkpoint.enable=false", "--metrics.enable_tensorboard=false"]
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.only in (None, "debug"):
            debug = [*common, f"--job.dump_folder={workdir}/debug", "--training.global_batch_size=64"]
            results = [run(w, str(root / "train_configs/debug_model.toml"), debug, 20, 3, workdir) for w in (1, 2, 4)]
            report("debug model (SanaMS_digits, 8x8 pixels, global batch 64, fp32)", results)
        if args.only in (None, "600m"):
            data = synthetic_features(workdir, 8)
            big = [
                *common,
                f"--job.dump_folder={workdir}/600m",
                "--model.name=SanaMS_600M_P1_D28",
                "--model.input_size=16",
                f"--data.path={data}",
                "--model.model_max_length=300",
                "--training.global_batch_size=2",
                "--training.mixed_precision_param=float32",
                "--lr_scheduler.warmup_steps=0",
            ]
            config = str(root / "train_configs/debug_model.toml")
            results = [run(w, config, big, 2, 1, workdir) for w in (1, 2)]
            results.append(run(2, config, [*big, "--activation_checkpoint.mode=full"], 2, 1, workdir, "AC full"))
            report("SanaMS_600M_P1_D28 at 512px (latents 32x16x16, 300 caption tokens, global batch 2, fp32)", results)


if __name__ == "__main__":
    main()
