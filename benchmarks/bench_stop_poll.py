"""What the preemption safe points cost: the trainer's stop agreement (one all-reduce of 5 floats on
CPU tensors at each agreement point: every safe point until a step is timed, then about once a second)
against a micro-batch of the debug model.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/bench_stop_poll.py [--polls 2000]

Times `StopAgreement.poll` alone (no stop requested: the path every micro-batch takes), then a
forward and backward pass of one micro-batch of the debug run's model (SanaMS_digits, FSDP2, local
batch 32, fp32) on the same ranks, and prints both and their ratio. Rank 0 prints.
"""

import argparse
import time

import torch
import torch.distributed as dist

from sana2.components.preemption import StopAgreement, StopSignal
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.parallelize import apply_fsdp
from sana2.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--micro-batches", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agreement = StopAgreement(StopSignal(), grace_period=60.0, rank=rank)
    for _ in range(50):  # warm the connections
        agreement.poll(0.0, 1)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.polls):
        agreement.poll(0.5, 1)
    poll = (time.perf_counter() - start) / args.polls

    mesh = ParallelDims(1, dist.get_world_size()).fsdp_mesh
    with torch.device("meta"):
        model = build_model("SanaMS_digits")
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    batch = 32
    latents = torch.randn(batch, model.in_channels, 8, 8)
    timesteps = torch.randint(0, 1000, (batch,))
    captions = torch.randn(batch, 1, *model.caption_shape)
    mask = torch.ones(batch, model.caption_shape[0], dtype=torch.long)
    model.set_requires_gradient_sync(False)
    for _ in range(3):
        model(latents, timesteps, captions, mask).square().mean().backward()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.micro_batches):
        model(latents, timesteps, captions, mask).square().mean().backward()
    micro_batch = (time.perf_counter() - start) / args.micro_batches
    if rank == 0:
        print(f"world size {dist.get_world_size()}, gloo, OMP_NUM_THREADS={torch.get_num_threads()}")
        print(f"stop agreement (poll):        {poll * 1e6:8.1f} us   ({args.polls} polls)")
        print(f"debug model micro-batch (32): {micro_batch * 1e3:8.2f} ms   ({args.micro_batches} forward+backward)")
        print(f"overhead per micro-batch:     {poll / micro_batch:8.2%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
