"""Process group, device and mesh set-up: gloo on CPU, nccl on CUDA, chosen automatically."""

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_distributed(timeout_minutes: int = 30) -> tuple[int, int, torch.device]:
    """Join the torchrun job (or start a one-process group) and return (rank, world_size, device)."""
    if "RANK" not in os.environ:  # plain `python -m sana2.train`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    return dist.get_rank(), dist.get_world_size(), device


def build_dp_mesh(device: torch.device, replicate: int, shard: int) -> DeviceMesh:
    """1-D mesh for full sharding; 2-D (replicate, shard) mesh for hybrid sharding (HSDP)."""
    if replicate == 1:
        return init_device_mesh(device.type, (shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
