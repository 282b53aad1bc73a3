"""Measure the activation memory of each block kind on CPU and write sana2/planning/activations.json.

    python benchmarks/calibrate_activations.py                 # the shipped kinds (image, Sana-1.5, video)
    python benchmarks/calibrate_activations.py --model SanaMS_600M_P1_D28 --model.qk_norm=true
    python benchmarks/calibrate_activations.py --only runtime  # only the CPU runtime of training processes

Method. For each block kind (a registered model's block structure), compute dtype (float32,
bfloat16) and activation checkpointing mode (none, full), a 2-block model of the kind is built at
small widths and run for one training step (rectified-flow MSE, as the trainer) over a grid of batch
sizes, token counts, caption lengths and widths. `LiveBytes` counts every tensor byte alive at the
moments the plan needs (sana2/planning/calibration.py): what the stem and each block keep for
backward, and the peaks inside a block's forward and backward and the loss's backward. Least
squares (in bytes, so the large sizes weigh most) turns the grid into bytes per token x channel, per
caption token x channel, per sample x channel, per input element and per width squared; batches of one
sample and of several are fitted apart. Every tensor an activation consists of is a product of these
dimensions, so the fit extrapolates to full sizes. The peak inside a backward is the largest of a few
moments (weight-sized gradient temporaries against activation-sized ones), which a linear fit only
approximates at the smallest sizes; the script prints the largest error on the grid and on two
configurations outside it (a width between the grid's, twice its largest token count), each relative
to what one block and the stem hold.

The CPU runtime (Python, torch, gloo, the data loader) is the peak RSS of a training process whose
model is negligible (a 2-block, width-64 DiT), run under torchrun at 1, 2 and 4 ranks with glibc's
mmap threshold pinned (see benchmarks/bench_memory_plan.py), less the plan's prediction for its
tensors. The plan adds it when asked about `--device cpu`.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sana2.config import load_config  # noqa: E402
from sana2.distributed.parallelize import apply_activation_checkpointing  # noqa: E402
from sana2.models import build_model  # noqa: E402
from sana2.planning.activations import CALIBRATION_FILE, FORMAT, block_kind  # noqa: E402
from sana2.planning.calibration import fit, fit_errors, measure_step, model_shape  # noqa: E402

# the shipped kinds: one registered model each, and the small sizes their grid is measured at
IMAGE = {
    "widths": [(256, 4), (512, 8)],
    "grids": [(8, 8), (16, 16), (32, 32)],
    # outside the grid (width, heads, latent grid, batch): a check of the fit where it extrapolates
    "held_out": [(384, 6, (48, 48), 1), (384, 6, (32, 32), 3)],
}
KINDS = {
    # image blocks: linear attention (head 32), GLUMBConv 2.5 (600M, 1600M, the debug models)
    "SanaMS_600M_P1_D28": IMAGE,
    # Sana-1.5: the same with qk_norm and cross_norm
    "SanaMS_1600M_P1_D20_sana1.5": IMAGE,
    # video blocks: linear attention (head 112) with 3-D RoPE, GLUMBConvTemp 3.0
    "SanaMSVideo_2000M_P2_D20": {
        "widths": [(224, 2), (448, 4)],
        "grids": [(2, 8, 8), (4, 16, 16), (8, 16, 16), (8, 32, 32)],
        "held_out": [(336, 3, (16, 32, 32), 1), (336, 3, (8, 32, 32), 2)],
    },
}
BATCHES = (1, 2, 4)
CAPTION_LENGTHS = (16, 48)
HELD_OUT_CAPTION_LENGTH = 24
CAPTION_CHANNELS = 64
DTYPES = ("float32", "bfloat16")
AC_MODES = ("none", "full")


def measure(name, overrides, kind, dtype, mode, width, heads, grid, batch, caption_length):
    kwargs = {
        **overrides,
        "depth": 2,
        "hidden_size": width,
        "num_heads": heads,
        "caption_channels": CAPTION_CHANNELS,
        "model_max_length": caption_length,
        "input_size": grid[-1],
    }
    torch.manual_seed(0)
    model = build_model(name, **kwargs).to(getattr(torch, dtype))
    assert block_kind(model) == kind, (block_kind(model), kind)
    apply_activation_checkpointing(model, mode)
    latent_shape = (model.in_channels, *grid)
    shape = model_shape(model, batch, latent_shape, caption_length)
    return shape, measure_step(model, batch, latent_shape, caption_length)


def measure_kind(name: str, overrides: dict, spec: dict) -> tuple[str, dict]:
    with torch.device("meta"):
        kind = block_kind(build_model(name, **overrides))
    fits, grid_errors, held_out_errors = {}, {}, {}
    for dtype in DTYPES:
        for mode in AC_MODES:
            samples = [
                measure(name, overrides, kind, dtype, mode, width, heads, grid, batch, length)
                for width, heads in spec["widths"]
                for length in CAPTION_LENGTHS
                for grid in spec["grids"]
                for batch in BATCHES
            ]
            held_out = [
                measure(name, overrides, kind, dtype, mode, width, heads, grid, batch, HELD_OUT_CAPTION_LENGTH)
                for width, heads, grid, batch in spec["held_out"]
            ]
            for regime, single in (("single_sample", True), ("batched", False)):
                chosen = [s for s in samples if (s[0]["batch"] == 1) == single]
                checks = [s for s in held_out if (s[0]["batch"] == 1) == single]
                coefficients, errors = fit(chosen)
                fits.setdefault(dtype, {}).setdefault(mode, {})[regime] = coefficients
                key = f"{dtype}/{mode}/{regime}"
                grid_errors[key] = max(errors.values())
                held_out_errors[key] = max(fit_errors(coefficients, checks).values())
                print(
                    f"  {key:30s} {len(chosen):3d} runs: largest error on the grid {grid_errors[key]:6.2%}, "
                    f"outside it {held_out_errors[key]:6.2%}",
                    flush=True,
                )
    entry = {
        "calibrated_with": {"model": name, "overrides": overrides},
        "fits": fits,
        "grid_errors": grid_errors,
        "held_out_errors": held_out_errors,
    }
    return kind, entry


# -- the CPU runtime of a training process --------------------------------------------------------
RUNTIME_MODEL = [
    "--model.name=SanaMS_digits",
    "--model.depth=2",
    "--model.hidden_size=64",
    "--model.num_heads=2",
    "--training.local_batch_size=1",
    "--training.mixed_precision_param=float32",
    "--validation.enable=false",
    "--checkpoint.enable=false",
    "--metrics.enable_tensorboard=false",
]


def runtime_bytes(data: dict, world_sizes=(1, 2, 4)) -> dict[str, int]:
    """Peak RSS of a negligible training run per world size, less the plan's tensor bytes for it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_memory_plan import PINNED_MMAP_THRESHOLD, measure_training_peak, planned

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [*RUNTIME_MODEL, f"--job.dump_folder={tmp}/runtime"]
        measure_training_peak(None, overrides, 1, 1, Path(tmp))  # builds the digits cache outside the runs
        for n in world_sizes:
            measured = measure_training_peak(None, overrides, n, 3, Path(tmp), PINNED_MMAP_THRESHOLD)
            tensors = planned(None, overrides, n, {**data, "cpu_runtime_bytes": {"1": 0}}).estimate.peak
            out[str(n)] = measured - tensors
            print(
                f"  {n} rank(s): peak RSS {measured / 2**20:.0f} MiB, tensors {tensors / 2**20:.1f} MiB "
                f"-> runtime {out[str(n)] / 2**20:.0f} MiB",
                flush=True,
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="calibrate this registered model's block kind (default: the shipped kinds)")
    parser.add_argument("--only", choices=("kinds", "runtime"), help="measure only the block kinds or the CPU runtime")
    parser.add_argument("--out", default=str(CALIBRATION_FILE))
    args, rest = parser.parse_known_args()
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    path = Path(args.out)
    data = json.loads(path.read_text()) if path.exists() else {"format": FORMAT, "version": 1, "kinds": {}}
    if args.only != "runtime":
        if args.model:
            overrides = load_config(None, [f"--model.name={args.model}", *rest]).model.overrides
            spec = KINDS["SanaMSVideo_2000M_P2_D20" if "Video" in args.model else "SanaMS_600M_P1_D28"]
            chosen = {args.model: {**spec, "overrides": overrides}}
        else:
            chosen = {name: {**spec, "overrides": {}} for name, spec in KINDS.items()}
        for name, spec in chosen.items():
            start = time.time()
            print(f"{name} {spec['overrides'] or ''}", flush=True)
            kind, entry = measure_kind(name, spec["overrides"], spec)
            data["kinds"][kind] = entry
            print(f"  kind {kind!r}: {time.time() - start:.0f}s", flush=True)
    if args.only != "kinds":
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")  # the runtime run plans with it
        print("CPU runtime of a training process", flush=True)
        data["cpu_runtime_bytes"] = runtime_bytes(data)
    # which command measured each part (a run may measure only one of them)
    provenance = {
        "torch": torch.__version__,
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", *sys.argv]),
    }
    for part in ("kinds", "runtime"):
        if args.only in (None, part):
            data.setdefault("measured", {})[part] = provenance
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
