"""Context parallelism on CPU: peak memory per rank and step time, cp = 1 vs cp = 2, beside the plan.

    OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel.py [--frames 12] [--steps 5]

A small video model whose blocks are the 2B's kind (linear attention with head size 112, qk norm,
rope, GLUMBConvTemp with a temporal kernel of 3; the plan's calibration covers that kind), in fp32,
on clips of 16 x F x 8 x 8 latents (F = 12: 4x the tokens of the tests' tiny 3-frame clip). Two
processes (gloo) train with FSDP over both ranks and AdamW:
- cp = 1: each rank trains its own whole clip (data parallel, global batch 2);
- cp = 2: the two ranks split one clip's frames (global batch 1).
Each rank counts its live tensor bytes during a step exactly (sana2.planning.live_bytes.LiveBytes,
what the plan predicts besides the runtime) and its peak RSS; the plan (`python -m sana2.plan ...
--device cpu`) predicts the same run from the config alone.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
MODEL = dict(
    hidden_size=224, depth=2, num_heads=2, linear_head_dim=112, caption_channels=16, model_max_length=5, input_size=8
)
MIB = 2**20


def overrides(degree: int) -> list[str]:
    model = [f"--model.{key}={value}" for key, value in MODEL.items()]
    return [
        "--model.name=SanaMSVideo",
        *model,
        "--training.local_batch_size=1",
        "--training.mixed_precision_param=float32",
        "--training.ema_decay=0",
        "--optimizer.name=adamw",
        "--activation_checkpoint.mode=none",
        f"--parallelism.context_parallel_degree={degree}",
    ]


def worker(rank: int, world_size: int, degree: int, frames: int, steps: int, out: str) -> None:
    import resource

    import torch.distributed as dist

    from sana2.components.flow import model_timestep, noised
    from sana2.distributed.context_parallel import ContextParallel, apply_context_parallel, min_frames_per_rank
    from sana2.distributed.initialize import init_weights
    from sana2.distributed.parallel_dims import ParallelDims
    from sana2.distributed.parallelize import apply_fsdp, materialize
    from sana2.models import build_model
    from sana2.planning.live_bytes import LiveBytes

    dims = ParallelDims(1, world_size // degree, degree)  # FSDP over every rank, cp included
    with torch.device("meta"):
        model = build_model("SanaMSVideo", **MODEL)
    cp = ContextParallel(dims.cp_mesh.get_group()) if degree > 1 else None
    if cp:
        apply_context_parallel(model, cp)
    apply_fsdp(model, dims.fsdp_mesh, param_dtype=torch.float32)
    materialize(model, torch.device("cpu"))
    init_weights(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    # cp = 1: a clip per rank; cp = 2: both ranks hold the same clip and take their frames of it
    generator = torch.Generator().manual_seed(rank if cp is None else 0)
    x0 = torch.randn(1, 16, frames, 8, 8, generator=generator)
    noise = torch.randn(1, 16, frames, 8, 8, generator=generator)
    captions, sigma = torch.randn(1, 1, 5, 16, generator=generator), torch.tensor([0.5], dtype=torch.float64)
    split = cp.split(frames, min_frames=min_frames_per_rank(model)) if cp else None
    if split:
        x0, noise = split.take(x0), split.take(noise)

    def step():
        x_t, target = noised(x0, noise, sigma)
        prediction = model(x_t, model_timestep(sigma), captions, None, drop_ids=torch.tensor([False]))
        loss = (prediction - target).pow(2).flatten(1).mean(1)
        if split:
            loss = cp.whole_sample_loss(loss, split)
        loss.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up; creates the optimizer state
    times = []
    for _ in range(steps):
        dist.barrier()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    # one more step under the live-bytes counter (it slows ops down): what existed before the step
    # (shards, buffers, optimizer state) counts from zero, so it is added back
    state = [t for t in optimizer.state.values() for t in t.values() if torch.is_tensor(t)]
    known = [*(p.to_local() for p in model.parameters()), *model.buffers(), *state]
    with LiveBytes(known=known) as live:
        step()
    tensor_peak = live.peak + sum(t.numel() * t.element_size() for t in known)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"rank": rank, "times": times, "tensor_peak": tensor_peak, "rss_peak": rss}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def planned(degree: int, frames: int):
    from sana2.config import load_config
    from sana2.plan import make_memory_plan

    config = load_config(None, overrides(degree))
    return make_memory_plan(config, 2, device="cpu", latent_shape=(16, frames, 8, 8))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from dist_utils import run_distributed

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("command: OMP_NUM_THREADS=1 python benchmarks/bench_context_parallel.py " + " ".join(sys.argv[1:]))
    print(
        "| cp | tokens per rank | measured tensor peak MiB (max over ranks) | planned (peak - runtime) MiB | "
        "planned peak incl. runtime MiB | measured peak RSS MiB | step s (median) | planned cp bytes sent/step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for degree in (1, 2):
        estimate = planned(degree, args.frames).estimate
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            run_distributed(worker, 2, degree, args.frames, args.steps, str(out))
            results = json.loads(out.read_text())
        tensor_peak = max(r["tensor_peak"] for r in results)
        rss = max(r["rss_peak"] for r in results)
        step = sorted(max(times) for times in zip(*(r["times"] for r in results)))  # the slowest rank
        median = step[len(step) // 2]
        tensors_planned = estimate.peak - estimate.setup.runtime_bytes
        print(
            f"| {degree} | {estimate.setup.rank_tokens} | {tensor_peak / MIB:.2f} | {tensors_planned / MIB:.2f} | "
            f"{estimate.peak / MIB:.1f} | {rss / MIB:.1f} | {median:.3f} | "
            f"{estimate.context_parallel / 1024:.1f} KiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
