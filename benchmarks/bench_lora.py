"""LoRA rank 32 vs full fine-tuning of SanaMS_600M_P1_D28 at 512px on 2 CPU processes: peak memory per
rank, step time and checkpoint size, each beside what sana2 predicts.

    flock /tmp/sana2-heavy.lock python benchmarks/bench_lora.py [--ranks 2] [--steps 2] [--markdown FILE]

Both runs use the fine-tuning presets' settings (AdamW, EMA 0.999 for full and none for LoRA, full
activation checkpointing) but compute in fp32, as the other CPU benchmarks do (this machine's bf16 matmuls
are an order of magnitude slower than its fp32 ones; on a GPU the presets' bf16 halves the frozen base) on random
DC-AE-shaped latents and Gemma-shaped captions (benchmarks/bench_train.py's synthetic features), local
batch 1; the base's weights are the seeded initialisation (a released checkpoint would cost the same).
LoRA trains rank-32 adapters on the attention's q, k, v (attn.qkv, cross_attn.q_linear, kv_linear) over
a frozen base (held in the compute dtype).

Predictions: the peak is `sana2-plan`'s (`--device cpu`: live tensors plus the process runtime, measured
under MALLOC_MMAP_THRESHOLD_=131072 as benchmarks/bench_memory_plan.py explains); the checkpoint is the
trainable parameters (from the plan's dry run on meta) times their saved fp32 copies: the weights, AdamW's
two moments and the EMA when there is one (the frozen base is not saved: the checkpoint names it). The
step time has no prediction: it is measured, the mean over --steps after one warm-up step.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_memory_plan import PINNED_MMAP_THRESHOLD, planned, write_markdown  # noqa: E402
from bench_train import run, synthetic_features  # noqa: E402

GIB = 2**30
MIB = 2**20
CONFIG = str(ROOT / "train_configs/debug_model.toml")
LORA = [
    '--model_transforms.names=["lora"]',
    "--lora.rank=32",
    "--lora.alpha=32.0",
    '--lora.target_modules=["attn.qkv", "cross_attn.q_linear", "cross_attn.kv_linear"]',
    "--training.ema_decay=0.0",
]
FULL = ["--training.ema_decay=0.999"]


def common(workdir: Path, name: str) -> list[str]:
    return [
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        f"--job.dump_folder={workdir}/{name}",
        "--checkpoint.interval=100000",  # only the benchmark's own final save
        "--model.name=SanaMS_600M_P1_D28",
        "--model.input_size=16",
        f"--data.path={synthetic_features(workdir, 8)}",
        "--model.model_max_length=300",
        "--training.mixed_precision_param=float32",  # bf16 matmuls are ~10x slower on these CPUs
        "--activation_checkpoint.mode=full",
        "--lr_scheduler.warmup_steps=0",
    ]


def predicted_checkpoint_bytes(config: str, overrides: list[str], world_size: int) -> int:
    """fp32 weights + AdamW's two moments (+ EMA) of the parameters that train; the rest is a reference."""
    from sana2.config import load_config
    from sana2.planning.dry_run import dry_run

    job = load_config(config, overrides)
    trainable = sum(p.numel() for p in dry_run(job, world_size).model.parameters() if p.requires_grad)
    copies = 1 + 2 + (1 if job.training.ema_decay > 0 else 0)
    return 4 * copies * trainable


def measure(label: str, overrides: list[str], ranks: int, steps: int, workdir: Path) -> dict:
    overrides = [*overrides, f"--training.global_batch_size={ranks}"]
    plan = planned(CONFIG, overrides, ranks)
    result = run(ranks, CONFIG, overrides, steps, 1, workdir, label, save=True, env=PINNED_MMAP_THRESHOLD)
    return {
        "label": label,
        "ranks": ranks,
        "predicted_peak": plan.estimate.peak,
        "measured_peak": max(result["peak_gib_per_rank"]) * GIB,
        "step_seconds": result["step_seconds"],
        "predicted_checkpoint": predicted_checkpoint_bytes(CONFIG, overrides, ranks),
        "measured_checkpoint": result["checkpoint_bytes"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| run | ranks | peak GiB/rank, plan | peak GiB/rank, measured | error | step s | checkpoint MiB, predicted "
        "| checkpoint MiB, on disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        error = (r["predicted_peak"] - r["measured_peak"]) / r["measured_peak"]
        lines.append(
            f"| {r['label']} | {r['ranks']} | {r['predicted_peak'] / GIB:.2f} | {r['measured_peak'] / GIB:.2f} | "
            f"{error:+.1%} | {r['step_seconds']:.1f} | {r['predicted_checkpoint'] / MIB:.1f} | "
            f"{r['measured_checkpoint'] / MIB:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for label, extra in (("LoRA rank 32", LORA), ("full fine-tuning, EMA", FULL)):
            rows.append(measure(label, [*common(workdir, label.split()[0]), *extra], args.ranks, args.steps, workdir))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    if args.markdown:
        write_markdown(Path(args.markdown), table(rows))


if __name__ == "__main__":
    main()
