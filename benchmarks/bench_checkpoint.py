"""Save and load time and throughput of the trainer's DCP checkpoints for a real-size model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_checkpoint.py \
        [--model SanaMS_600M_P1_D28] [--folder /tmp/sana2-bench-checkpoint] [--keep]

Builds the model on the meta device, shards it with FSDP2 over the gloo ranks (fp32), materialises
and initialises it, creates the AdamW state (DCP's helper runs one zero-gradient, zero-lr step),
then times through `CheckpointManager`, the trainer's own code path:
  sync save   training blocked for the whole write (DCP files, CRC32 lists, fsync, rename)
  async save  training blocked only while the state is staged (copied) in memory; the write and
              its publication run in a thread, timed until the checkpoint is visible
  load        the CRC32-verified load the trainer resumes with, into the live model and optimizer,
              and plain `dcp.load` of the same folder (what the verification costs)
Each save runs twice (keep_latest_k=1): the first of a kind touches fresh memory for the page
cache and the staging copy, which is slow on a virtual machine. Throughput is the checkpoint's
bytes on disk over the time. Loads right after the saves read mostly from the page cache
(dropping it would disturb other users of the machine).

Checks free disk (three checkpoints) and available memory (the state twice, for async staging)
first and stops with a message if they are short.
"""

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from sana2.components.checkpoint import CheckpointManager
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.parallelize import apply_fsdp
from sana2.models import build_model

GB = 1e9
MARGIN_BYTES = 2 * 10**9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SanaMS_600M_P1_D28")
    parser.add_argument("--folder", default="/tmp/sana2-bench-checkpoint")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints on disk")
    return parser.parse_args()


def available_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def preflight(name: str, folder: Path) -> tuple[int, str | None]:
    """(checkpoint bytes, None) or (bytes, why the machine cannot run this benchmark now)."""
    with torch.device("meta"):
        model = build_model(name)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    checkpoint_bytes = 3 * parameter_bytes  # weights + AdamW exp_avg + exp_avg_sq
    folder.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(folder).free
    if free_disk < 3 * checkpoint_bytes + MARGIN_BYTES:  # sync + async, and the next before retention
        return checkpoint_bytes, (
            f"{folder} has {free_disk / GB:.1f} GB free; three checkpoints need {3 * checkpoint_bytes / GB:.1f} GB"
        )
    memory = available_memory_bytes()
    if memory < 2 * checkpoint_bytes + MARGIN_BYTES:  # live state + its async staging copy
        return checkpoint_bytes, (
            f"{memory / GB:.1f} GB memory available; the state and its async copy need "
            f"{2 * checkpoint_bytes / GB:.1f} GB"
        )
    return checkpoint_bytes, None


def build_sharded_model_and_adamw(name: str, world_size: int):
    with torch.device("meta"):
        model = build_model(name)
    apply_fsdp(model, ParallelDims(1, world_size).fsdp_mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def training_state(model, optimizer) -> dict:
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
        "train_state": {"step": 1},
    }


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir())


def timed(function) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    folder = Path(args.folder)
    verdict = [preflight(args.model, folder) if rank == 0 else None]
    dist.broadcast_object_list(verdict, src=0)
    expected_bytes, problem = verdict[0]
    if problem:
        if rank == 0:
            print(f"not running: {problem}")
        dist.destroy_process_group()
        return

    start = time.perf_counter()
    model, optimizer = build_sharded_model_and_adamw(args.model, world_size)
    state = training_state(model, optimizer)  # creates the AdamW state
    parameters = sum(p.numel() for p in model.parameters())
    build_seconds = time.perf_counter() - start
    files = {"config.json": "{}"}
    rows = []

    # each twice: the first save of a kind touches fresh memory (page cache, staging copy)
    sync_manager = CheckpointManager(folder / "sync", 1, 1, "disabled", rank)
    for step in (1, 2):
        seconds = timed(lambda step=step: sync_manager.save(step, state, files))
        size = folder_bytes(sync_manager.final_path(step))
        rows.append((f"sync save #{step}", f"blocked {seconds:6.1f} s", f"{size / seconds / 1e6:6.0f} MB/s"))

    async_manager = CheckpointManager(folder / "async", 1, 1, "async", rank)
    for step in (1, 2):
        blocked = []
        seconds = timed(
            lambda step=step, blocked=blocked: (
                blocked.append(async_manager.save(step, training_state(model, optimizer), files)),
                async_manager.wait(),
            )
        )
        rows.append(
            (
                f"async save #{step}",
                f"blocked {blocked[0]:6.1f} s, visible after {seconds:.1f} s",
                f"{size / seconds / 1e6:6.0f} MB/s",
            )
        )

    path = sync_manager.final_path(2)
    seconds = timed(lambda: sync_manager.load(path, training_state(model, optimizer)))
    rows.append(("load, CRC32-verified", f"{seconds:6.1f} s", f"{size / seconds / 1e6:6.0f} MB/s"))
    seconds = timed(lambda: dcp.load(training_state(model, optimizer), checkpoint_id=str(path)))
    rows.append(("load, plain dcp.load", f"{seconds:6.1f} s", f"{size / seconds / 1e6:6.0f} MB/s"))

    if rank == 0:
        print(
            f"{args.model}: {parameters / 1e6:.1f}M parameters, FSDP2 over {world_size} gloo ranks, fp32, AdamW; "
            f"built in {build_seconds:.0f} s"
        )
        print(
            f"checkpoint {size / GB:.2f} GB on disk (expected {expected_bytes / GB:.2f} GB: weights + 2 AdamW "
            f"moments), {world_size} shards, in {folder}"
        )
        for name, time_text, rate in rows:
            print(f"  {name:22s} {time_text:40s} {rate}")
        if not args.keep:
            shutil.rmtree(folder / "sync", ignore_errors=True)
            shutil.rmtree(folder / "async", ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
