"""Scaling figures: per-rank memory and samples/s against world size, by sharding strategy, reshard_after_forward
and activation checkpointing; writes markdown tables and a PNG (needs the `bench` extra: matplotlib).

    python benchmarks/bench_scaling.py                     # both parts, into benchmarks/results/
    python benchmarks/bench_scaling.py --only plan         # the planned part only (seconds)

Planned (python -m sana2.plan, 1 to 1024 ranks of 80 GB GPUs): SanaMS_1600M at 1024px, bf16, a local batch
of 8 per rank. Strategies: FSDP (shard over all ranks), HSDP (shard within nodes of 8, replicate across),
no sharding (replicate everywhere, DDP-like), FSDP with reshard_after_forward off; AC none / selective /
full for FSDP. Measured (this machine, CPU, gloo, 1, 2 and 4 processes on 2 cores): the debug model at a
global batch of 64, samples/s and per-rank peak RSS (glibc mmap threshold pinned, as in
bench_memory_plan.py) next to the plan's prediction.
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
GIB = 2**30
WORLD_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
BIG = [
    "--training.global_batch_size=0",
    "--training.local_batch_size=8",
    "--training.mixed_precision_param=bfloat16",
]
PLANNED = {
    "FSDP, AC full": [],
    "HSDP (8 per node), AC full": ["HSDP"],
    "no sharding, AC full": ["--parallelism.data_parallel_shard_degree=1", "REPLICATE"],
    "FSDP, reshard_after_forward off": ["--parallelism.reshard_after_forward=false"],
    "FSDP, AC selective (every 2nd)": ["--activation_checkpoint.mode=selective"],
    "FSDP, AC none": ["--activation_checkpoint.mode=none"],
}
MEASURED = {
    "FSDP": [],
    "no sharding": ["REPLICATE"],
    "HSDP (2 x 2)": ["HSDP2"],
    "FSDP, reshard_after_forward off": ["--parallelism.reshard_after_forward=false"],
    "FSDP, AC full": ["--activation_checkpoint.mode=full"],
}


def resolve(overrides: list[str], world: int) -> list[str] | None:
    """Turn the placeholders into degrees for this world size; None where the strategy does not apply."""
    out = []
    for item in overrides:
        if item == "HSDP":
            if world < 8:
                return None
            out.append(f"--parallelism.data_parallel_replicate_degree={world // 8}")
        elif item == "HSDP2":
            if world != 4:
                return None
            out.append("--parallelism.data_parallel_replicate_degree=2")
        elif item == "REPLICATE":
            out.append(f"--parallelism.data_parallel_replicate_degree={world}")
        else:
            out.append(item)
    return out


def planned_part() -> tuple[dict, dict]:
    from sana2.config import load_config
    from sana2.plan import make_memory_plan

    memory, traffic = {}, {}
    config = str(ROOT / "train_configs/sana_1600m_img1024.toml")
    for label, overrides in PLANNED.items():
        for world in WORLD_SIZES:
            resolved = resolve(overrides, world)
            if resolved is None:
                continue
            nodes, per_node = (world // 8, 8) if world >= 8 else (1, world)
            estimate = make_memory_plan(load_config(config, [*BIG, *resolved]), per_node, nodes).estimate
            memory.setdefault(label, {})[world] = estimate.peak / GIB
            traffic.setdefault(label, {})[world] = (
                estimate.all_gather + estimate.reduce_scatter + estimate.all_reduce
            ) / GIB
    return memory, traffic


def measured_part() -> tuple[dict, dict, dict]:
    import os

    from bench_memory_plan import COMMON, PINNED_MMAP_THRESHOLD, planned
    from bench_train import run

    speed, rss, plan = {}, {}, {}
    config = str(ROOT / "train_configs/debug_model.toml")
    os.environ.update(PINNED_MMAP_THRESHOLD)  # the workers inherit it
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        base = [*COMMON, f"--job.dump_folder={workdir}/debug", "--training.global_batch_size=64"]
        run(1, config, base, 1, 0, workdir)  # builds the digits cache outside the timed runs
        for label, overrides in MEASURED.items():
            for world in (1, 2, 4):
                resolved = resolve(overrides, world)
                if resolved is None:
                    continue
                result = run(world, config, [*base, *resolved], 20, 3, workdir, label)
                speed.setdefault(label, {})[world] = result["samples_per_second"]
                rss.setdefault(label, {})[world] = max(result["peak_gib_per_rank"])
                plan.setdefault(label, {})[world] = planned(config, [*base, *resolved], world).estimate.peak / GIB
                print(
                    f"  {label:34s} {world} ranks: {result['samples_per_second']:7.1f} samples/s, "
                    f"peak RSS {rss[label][world]:.3f} GiB (plan {plan[label][world]:.3f})",
                    flush=True,
                )
    return speed, rss, plan


def markdown(title: str, unit: str, series: dict, digits: int = 2, extra: dict | None = None) -> str:
    worlds = sorted({w for values in series.values() for w in values})
    lines = [
        f"### {title}",
        "",
        "| " + unit + " | " + " | ".join(str(w) for w in worlds) + " |",
        "|---|" + "---:|" * len(worlds),
    ]
    for label, values in series.items():
        cells = []
        for w in worlds:
            if w not in values:
                cells.append("")
            elif extra:
                cells.append(f"{values[w]:.{digits}f} ({extra[label][w]:.{digits}f})")
            else:
                cells.append(f"{values[w]:.{digits}f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(path: Path, planned_memory: dict, measured: tuple | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if measured else 1
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    for label, values in planned_memory.items():
        worlds = sorted(values)
        ax.plot(worlds, [values[w] for w in worlds], marker="o", markersize=3, label=label)
    ax.axhline(80, color="grey", linestyle=":", label="80 GB GPU")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="world size (GPUs)",
        ylabel="peak GiB per rank",
        title="SanaMS_1600M 1024px, local batch 8 (plan)",
    )
    ax.set_xticks(WORLD_SIZES, [str(w) for w in WORLD_SIZES], fontsize=7)
    ax.legend(fontsize=7)
    if measured:
        speed, rss, plan = measured
        for label, values in speed.items():
            worlds = sorted(values)
            axes[0][1].plot(worlds, [values[w] for w in worlds], marker="o", label=label)
        axes[0][1].set(xlabel="processes", ylabel="samples/s", title="debug model on 2 CPU cores (measured)")
        axes[0][1].set_xticks([1, 2, 4])
        axes[0][1].legend(fontsize=7)
        for index, (label, values) in enumerate(rss.items()):
            worlds = sorted(values)
            color = f"C{index}"
            axes[0][2].plot(worlds, [values[w] for w in worlds], marker="o", color=color, label=f"{label}")
            axes[0][2].plot(worlds, [plan[label][w] for w in worlds], linestyle="--", color=color)
        axes[0][2].set(
            xlabel="processes", ylabel="peak RSS GiB per rank", title="debug model: measured (solid) vs plan (dashed)"
        )
        axes[0][2].set_xticks([1, 2, 4])
        axes[0][2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("plan", "measured"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    command = " ".join(["python", *sys.argv])
    print("command:", command, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    memory, traffic = planned_part()
    text = [
        f"command: `{command}`\n",
        markdown(
            "Planned peak GiB per rank, SanaMS_1600M at 1024px, local batch 8, bf16 (80 GB GPUs)",
            "GiB per rank \\ ranks",
            memory,
        ),
        markdown("Planned communication per optimizer step, GiB sent per rank", "GiB \\ ranks", traffic),
    ]
    measured = None
    if args.only != "plan":
        measured = measured_part()
        speed, rss, plan = measured
        text.append(
            markdown(
                "Measured samples/s, debug model, global batch 64, 2 CPU cores", "samples/s \\ processes", speed, 1
            )
        )
        text.append(
            markdown(
                "Measured peak RSS GiB per rank (plan in brackets), debug model", "GiB \\ processes", rss, 3, extra=plan
            )
        )
    (args.out / "scaling.md").write_text("\n".join(text))
    plot(args.out / "scaling.png", memory, measured)
    print("\n".join(text))
    print(f"wrote {args.out / 'scaling.md'} and {args.out / 'scaling.png'}")


if __name__ == "__main__":
    main()
