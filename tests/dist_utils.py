"""Run a function on N gloo processes on this machine (the test harness for distributed code), or a command
line under torchrun."""

import gc
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Workers fork from one server process that imported torch and sana2 once for the whole session: a spawned
# worker imports them anew, about 3 s a process on 2 cores, paid twice by every two-rank test.
mp.set_forkserver_preload(["sana2.train", "sana2.prepare", "sana2.sample", "pytest"])  # torch comes with them


def _worker(rank, world_size, port, fn, args, errors, environ, cwd):
    # a forked worker has the server's environment and folder: take the test's, as a spawned one would
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)
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
    """Call fn(rank, world_size, *args) in `world_size` processes forked from the session's server; re-raise the
    first failure.

    fn must be importable (a module-level function); results travel through files in tmp_path.
    """
    ctx = mp.get_context("forkserver")
    errors = ctx.SimpleQueue()
    worker_args = (world_size, free_port(), fn, args, errors, dict(os.environ), os.getcwd())
    try:
        mp.start_processes(_worker, args=worker_args, nprocs=world_size, start_method="forkserver")
    except mp.ProcessRaisedException as exc:
        raise AssertionError(errors.get() if not errors.empty() else str(exc)) from None


def torchrun_command(nproc: int, *command: str) -> list[str]:
    """torchrun on `nproc` local ranks, its rendezvous on a free port, running `command` (a script and its
    arguments, or "-m", a module and its arguments)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    return [*launcher, f"--master_port={free_port()}", *command]


def run_command(command: list[str], env_extra: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`command` from the repository root, one thread per process, nothing downloaded; its output as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
