"""The sampler: flow-matching Euler sampling with classifier-free guidance, its seeded noise, image grids.

Validation (sana2/components/validator.py) and `sana2-sample` both draw with `euler_sample`. It runs
the model's ordinary forward, so it works on a plain module and on an FSDP2-sharded one alike. With
FSDP2 every forward is a collective (each block all-gathers its parameters), so every rank must call
it, the same number of times, with batches that need the same number of forwards; no rank ever
gathers the full model.
"""

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from sana2.components.flow import model_timestep, sampling_sigmas
from sana2.seeding import seeded_generator


# Not torchvision.utils.make_grid: each torchvision release pins one exact torch build, so depending on it for
# these lines would let pip replace a user's torch (on a CPU machine, with a multi-GB CUDA build).
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
def eval_mode(model: nn.Module):
    """Switch off training behaviour (caption dropout) for the duration, then restore the mode."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def null_captions(model: nn.Module, batch_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The model's unconditional caption, repeated: [B, 1, L, C]."""
    null = model.null_caption().to(device=device, dtype=dtype)
    return null[None, None].expand(batch_size, 1, *null.shape)


def sampling_noise(seed: int, count: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The starting noise [count, *shape] of the validation images: image i's from its own seeded
    generator, so the images do not change with their number or the world size."""
    return torch.stack([torch.randn(shape, generator=seeded_generator("sampling", seed, i)) for i in range(count)])


@torch.no_grad()
def euler_sample(
    model: nn.Module,
    noise: torch.Tensor,
    caption_embeds: torch.Tensor,
    caption_mask: torch.Tensor,
    steps: int,
    cfg_scale: float,
    shift: float,
) -> torch.Tensor:
    """Integrate dx/dsigma = v from sigma 1 (x = noise) to sigma 0 with Euler; returns x0.

    noise: [B, C, H, W]; caption_embeds: [B, 1, L, C_cap] with L the model's max caption
    length (the null caption's length); caption_mask: [B, L]. The schedule is
    `sampling_sigmas(steps, shift)`; the model sees floor(1000 sigma), as in training.

    Classifier-free guidance runs [uncond; cond] as one batch through one forward and mixes
    v = v_u + cfg_scale (v_c - v_u). With cfg_scale == 1 that is v_c, so the unconditional
    half is skipped. The state x stays in the noise's dtype whatever the model computes in.
    """
    batch_size = noise.shape[0]
    guided = cfg_scale != 1.0
    captions, masks = caption_embeds, caption_mask
    if guided:
        null = null_captions(model, batch_size, caption_embeds.dtype, caption_embeds.device)
        if null.shape != caption_embeds.shape:
            raise ValueError(
                f"caption_embeds {tuple(caption_embeds.shape)} must match the null caption "
                f"{tuple(null.shape)} (pad captions to the model's max length)"
            )
        captions = torch.cat([null, caption_embeds])
        masks = torch.cat([caption_mask, caption_mask])
    sigmas = sampling_sigmas(steps, shift).tolist()
    x = noise
    with eval_mode(model):
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            model_input = torch.cat([x, x]) if guided else x
            timestep = model_timestep(torch.full((model_input.shape[0],), sigma, dtype=torch.float64))
            velocity = model(model_input, timestep.to(x.device), captions, masks).to(x.dtype)
            if guided:
                v_uncond, v_cond = velocity.chunk(2)
                velocity = v_uncond + cfg_scale * (v_cond - v_uncond)
            x = x + (sigma_next - sigma) * velocity
    return x
