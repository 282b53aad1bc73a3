"""What sampling shares besides the scheduler loop (sana2/components/schedulers.py): the seeded starting
noise, evaluation mode for the forwards, and the grid the images are shown in.

Validation (sana2/components/validator.py, which also computes the held-out loss) and `sana2-sample` both
draw through these and the schedulers.
"""

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

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


def sampling_noise(seed: int, count: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The starting noise [count, *shape] of the validation images: image i's from its own seeded
    generator, so the images do not change with their number or the world size."""
    return torch.stack([torch.randn(shape, generator=seeded_generator("sampling", seed, i)) for i in range(count)])
