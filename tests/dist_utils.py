"""Run a function on N gloo processes on this machine (the test harness for distributed code)."""

import gc
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except Exception:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        gc.collect()  # free FSDP/DCP objects first: tearing the group down under them can SIGABRT at exit
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Call fn(rank, world_size, *args) in `world_size` spawned processes; re-raise the first failure.

    fn must be importable (a module-level function); results travel through files in tmp_path.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _worker, args=(world_size, free_port(), fn, args, errors), nprocs=world_size, start_method="spawn"
        )
    except mp.ProcessRaisedException as exc:
        raise AssertionError(errors.get() if not errors.empty() else str(exc)) from None
