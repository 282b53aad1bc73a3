"""Process group and device set-up: gloo on CPU, nccl on CUDA, chosen automatically (the mesh: parallel_dims.py)."""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from sana2.staging import NoSpaceError


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or start a one-process group) and return (rank, world_size, device)."""
    if "RANK" not in os.environ:  # plain `python -m sana2.train`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside nccl: with CPU offload, gradient norms and optimizer reductions run on CPU tensors
        backend = "cuda:nccl,cpu:gloo"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size(), device


def run_on_rank0(fn, describe_failure, errors=(OSError, ValueError)):
    """fn() on rank 0 only, its result sent to every rank. If it fails with one of `errors`, every
    rank raises the same ValueError(describe_failure(exc)) instead of waiting forever for rank 0;
    a full disk (NoSpaceError, which names the path and the bytes) is raised on every rank as it is."""
    outcome = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", fn())
        except NoSpaceError as exc:
            outcome[0] = ("raise", exc)
        except errors as exc:
            outcome[0] = ("failed", describe_failure(exc))
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    status, value = outcome[0]
    if status == "raise":
        raise value
    if status == "failed":
        raise RunOnRank0Error(value)
    return value


class RunOnRank0Error(ValueError):
    """Raised on every rank when run_on_rank0's function failed on rank 0."""


def _job_store() -> dist.Store:
    """A client of the job's key-value store (under torchrun, its agent's) at MASTER_ADDR:MASTER_PORT."""
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=5))


def _user_error_key() -> str:
    # per attempt: a worker group restarted by torchrun must not read its predecessor's error
    return f"sana2/user_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def tell_the_job(message: str) -> None:
    """Leave `message`, an error a user must fix met on this rank alone, where the other ranks look
    when their collectives fail because this rank has gone (the first rank to tell wins)."""
    try:
        _job_store().compare_set(_user_error_key(), "", f"rank {dist.get_rank()}: {message}")
    except (KeyError, OSError, RuntimeError, ValueError):
        pass  # no store to reach: the launcher still reports this rank's error


def told_by_another_rank() -> str | None:
    """The error another rank of this job stopped with ("rank R: ..."), if it told the job one."""
    try:
        store = _job_store()
        return store.get(_user_error_key()).decode() if store.check([_user_error_key()]) else None
    except (KeyError, OSError, RuntimeError, ValueError):
        return None


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered parameters, so the next forward all-gathers the shards anew.

    A no-grad forward leaves units with reshard_after_forward=False gathered; after the shards are
    changed in place (e.g. EMA weights swapped in and out) those gathered copies are stale.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
