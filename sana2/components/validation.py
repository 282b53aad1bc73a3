"""Validation: image grids, the sampling noise, held-out loss (the sampler: sana2/components/schedulers.py).

Both the sampler and `validation_loss` run the model's ordinary forward, so they work on a
plain module and on an FSDP2-sharded one alike. With FSDP2 every forward is a collective (each
block all-gathers its parameters), so every rank must call these functions, the same number of
times, with batches that need the same number of forwards; no rank ever gathers the full model.
"""

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from sana2.components.flow import FlowMatching
from sana2.seeding import seeded_generator


def make_grid(images: torch.Tensor, nrow: int, padding: int = 1, pad_value: float = 0.0) -> torch.Tensor:
    """Tile images [N, C, H, W] into one image [C, H', W'], `nrow` images per row.

    The layout is torchvision's: every cell is framed by `padding` pixels of `pad_value`, so
    H' = rows * (H + padding) + padding and W' = cols * (W + padding) + padding, with
    cols = min(nrow, N), rows = ceil(N / cols); cells after the last image stay `pad_value`.
    """
    count, channels, height, width = images.shape
    cols = min(nrow, count)
    rows = math.ceil(count / cols)
    blanks = images.new_full((rows * cols - count, channels, height, width), pad_value)
    cells = torch.cat([images, blanks])
    # each cell carries its top and left frame; the grid's bottom and right frame come last
    cells = F.pad(cells, (padding, 0, padding, 0), value=pad_value)
    grid = rearrange(cells, "(r c) ch h w -> ch (r h) (c w)", r=rows, c=cols)
    return F.pad(grid, (0, padding, 0, padding), value=pad_value)


@contextmanager
def _eval_mode(model: nn.Module):
    """Switch off training behaviour (caption dropout) for the duration, then restore the mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def sampling_noise(seed: int, count: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The starting noise [count, *shape] of the validation images: image i's from its own seeded
    generator, so the images do not change with their number or the world size."""
    return torch.stack([torch.randn(shape, generator=seeded_generator("sampling", seed, i)) for i in range(count)])


def _check_same_batch_count(num_batches: int, device: torch.device) -> None:
    """Fail on every rank, instead of hanging in FSDP's all-gathers, if the counts differ."""
    if not dist.is_initialized():
        return
    bounds = torch.tensor([num_batches, -num_batches], dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ValueError(
            f"validation_loss needs the same number of batches on every rank (between {fewest} and {most})"
        )


@torch.no_grad()
def validation_loss(model: nn.Module, batches: list[dict], sigmas: tuple[float, ...], seed: int) -> float:
    """Mean training loss (FlowMatching's) over all ranks' held-out samples, each at every sigma in
    `sigmas`, without caption dropout.

    Each batch holds latents [b, C, H, W], caption_embeds [b, 1, L, C_cap], caption_mask [b, L]
    and indices [b] (global sample indices, which seed the noise). Sums and counts are
    all-reduced, so every rank returns the same global mean, and a sample contributes the same
    term however the samples are split across ranks. Every rank must pass the same number of
    batches (FSDP's forwards are collectives).
    """
    flow = FlowMatching(seed)
    # the compute device: parameters may live on the CPU (FSDP CPU offload), buffers never do
    device = model.null_caption().device
    _check_same_batch_count(len(batches), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with _eval_mode(model):
        for batch in batches:
            latents = batch["latents"]
            for key, sigma in enumerate(sigmas):
                draw = flow.draw_at(sigma, key, batch["indices"], tuple(latents.shape[1:])).to(latents.device)
                loss_sum += flow.loss(model, batch, draw).double().sum()
                count += latents.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=device)])
    if dist.is_initialized():
        dist.all_reduce(totals)
    if totals[1] == 0:
        raise ValueError("validation_loss got no held-out samples on any rank")
    return (totals[0] / totals[1]).item()
