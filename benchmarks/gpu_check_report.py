"""Helpers of benchmarks/gpu_check.sh: synthetic feature data, and one result line per training run.

    python benchmarks/gpu_check_report.py data OUT_DIR image|video [--smoke]
    python benchmarks/gpu_check_report.py result NAME DUMP_FOLDER CONFIG [--device cuda|cpu] -- OVERRIDES...

`result` reads the run's TensorBoard scalars (the last logged window: steady state, not the first steps)
and prints step time, tokens/s, MFU and peak memory next to what `python -m sana2.plan` predicts for the
same config and overrides on one rank. On CUDA it compares `max_memory_allocated` with the plan's tensors
(its peak less the runtime reserve) and `max_memory_reserved` with the plan's total; on CPU, peak RSS
with the plan's total.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30
# one sample's latents: DC-AE f32c32 of 1024x1024 images; Wan 2.1 of 81-frame 480x832 clips
LATENTS = {"image": (32, 32, 32), "video": (16, 21, 60, 104)}
SMOKE_LATENTS = {"image": (32, 4, 4), "video": (16, 3, 4, 4)}
CAPTION = (300, 2304)  # Gemma-2-2b-it embeddings


def write_data(out: Path, kind: str, smoke: bool, samples: int = 4) -> None:
    from sana2.data.writer import write_feature_dataset

    if (out / "meta.json").exists():
        return
    shape = (SMOKE_LATENTS if smoke else LATENTS)[kind]
    generator = torch.Generator().manual_seed(0)
    mask = torch.zeros(samples, CAPTION[0], dtype=torch.int64)
    mask[:, :120] = 1
    write_feature_dataset(
        out,
        torch.randn(samples, *shape, generator=generator).to(torch.bfloat16),
        torch.randn(samples, *CAPTION, generator=generator).to(torch.bfloat16),
        mask,
    )
    print(f"data: {samples} synthetic {kind} samples, latents {'x'.join(map(str, shape))}, captions 300x2304 -> {out}")


def last_scalars(dump: Path) -> dict[str, float]:
    """The last value of every scalar in the run's newest TensorBoard log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = sorted((dump / "tb").iterdir())
    if not runs:
        raise SystemExit(f"no TensorBoard run under {dump / 'tb'}")
    events = EventAccumulator(str(runs[-1]), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}


def result(name: str, dump: Path, config: str, device: str, overrides: list[str]) -> None:
    from sana2.config import load_config
    from sana2.plan import make_memory_plan

    scalars = last_scalars(dump)
    plan = make_memory_plan(load_config(config, overrides), 1, device=device).estimate
    tensors = plan.peak - plan.setup.runtime_bytes
    fields = [
        f"{name}:",
        f"step {scalars['step_seconds']:.3f}s",
        f"tokens/s {scalars['tokens_per_second']:,.0f}",
        f"MFU {scalars['mfu']:.1%}" if "mfu" in scalars else "MFU n/a (no GPU peak)",
    ]
    if "memory/max_over_ranks/max_allocated_gib" in scalars:
        allocated = scalars["memory/max_over_ranks/max_allocated_gib"]
        reserved = scalars["memory/max_over_ranks/max_reserved_gib"]
        fields.append(
            f"CUDA max allocated {allocated:.2f} GiB (plan {tensors / GIB:.2f}, {allocated * GIB / tensors - 1:+.0%})"
        )
        fields.append(f"max reserved {reserved:.2f} GiB (plan with runtime {plan.peak / GIB:.2f})")
    else:
        rss = scalars["memory/max_over_ranks/peak_rss_gib"]
        fields.append(f"peak RSS {rss:.2f} GiB (plan {plan.peak / GIB:.2f}, {rss * GIB / plan.peak - 1:+.0%})")
    if "validation/loss" in scalars:
        fields.append(f"validation loss {scalars['validation/loss']:.4f}")
    print("  ".join(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data")
    data.add_argument("out", type=Path)
    data.add_argument("kind", choices=sorted(LATENTS))
    data.add_argument("--smoke", action="store_true")
    res = sub.add_parser("result")
    res.add_argument("name")
    res.add_argument("dump", type=Path)
    res.add_argument("config")
    res.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args, overrides = parser.parse_known_args()  # result: the run's --section.key=value overrides follow
    if args.command == "data":
        write_data(args.out, args.kind, args.smoke)
    else:
        result(args.name, args.dump, args.config, args.device, [o for o in overrides if o != "--"])


if __name__ == "__main__":
    main()
