"""What context parallelism changes in a step's memory and traffic (sana2/distributed/context_parallel.py).

A rank of a cp group of degree c holds ceil(F / c) of a clip's F patch frames (the first ranks hold the
longer runs), so its activations are those of that many frames. On top, per block:
- linear attention's sums (sum phi(k) v^T, sum phi(k)): B x heads x (d^2 + d) fp32 values, concatenated
  into one buffer and all-reduced (a ring all-reduce sends 2 (c - 1) / c of it), once in forward, once
  for the gradient in backward, and once more in a checkpointed block's recomputation;
- the temporal convolution's halo: k // 2 frames to each neighbour (B x D x frames x tokens per frame,
  compute dtype), in forward and (the halo's gradient) in backward; the padded input the convolution
  saves holds those halo frames too.
"""

import math
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ClipGeometry:
    """The shape facts of a video model and its clip that context parallelism's costs depend on."""

    frames: int  # patch frames of the clip
    tokens_per_frame: int
    width: int  # hidden size D
    heads: int
    head_dim: int
    halo_frames: int  # k // 2 of the temporal convolution (0 without one)
    blocks: int
    temporal_blocks: int  # blocks with a temporal convolution

    @classmethod
    def of(cls, model: nn.Module, latent_shape: tuple[int, ...]) -> "ClipGeometry | None":
        """The geometry of `model` for latents [C, F, H, W]; None for an image model."""
        if len(latent_shape) != 4 or len(model.patch_size) != 3:
            return None
        grid = [size // p for size, p in zip(latent_shape[1:], model.patch_size)]
        halos = [getattr(block.mlp, "halo_frames", 0) for block in model.blocks]
        head_dim = model.blocks[0].attn.head_dim
        return cls(
            frames=grid[0],
            tokens_per_frame=grid[1] * grid[2],
            width=model.hidden_size,
            heads=model.hidden_size // head_dim,
            head_dim=head_dim,
            halo_frames=max(halos),
            blocks=len(model.blocks),
            temporal_blocks=sum(1 for h in halos if h),
        )

    def rank_frames(self, degree: int) -> int:
        """The most frames one rank of a cp group of `degree` holds."""
        return math.ceil(self.frames / degree)

    def sums_bytes(self, batch: int) -> int:
        """One block's attention sums for `batch` samples (fp32)."""
        return batch * self.heads * (self.head_dim**2 + self.head_dim) * 4

    def halo_bytes(self, batch: int, dtype_bytes: int) -> int:
        """One side's halo of one temporal block: k // 2 frames."""
        return batch * self.width * self.halo_frames * self.tokens_per_frame * dtype_bytes


def buffer_bytes(clip: ClipGeometry, degree: int, batch: int, dtype_bytes: int) -> int:
    """What a block holds at once for cp's communication: the concatenated sums and their reduced copy,
    and both halos' send and receive buffers."""
    if degree == 1:
        return 0
    return 2 * clip.sums_bytes(batch) + 4 * clip.halo_bytes(batch, dtype_bytes)


def retained_halo_bytes(clip: ClipGeometry, degree: int, batch: int, dtype_bytes: int) -> int:
    """The halo frames inside one temporal block's saved, padded convolution input."""
    return 0 if degree == 1 else 2 * clip.halo_bytes(batch, dtype_bytes)


def bytes_sent(clip: ClipGeometry, degree: int, batch: int, dtype_bytes: int, recomputed_blocks: int) -> int:
    """Bytes the busiest rank sends for cp in one micro-batch: the sums' ring all-reduce and both
    halos, in forward, backward and the recomputed forward of `recomputed_blocks` checkpointed blocks."""
    if degree == 1:
        return 0
    passes = 2 * clip.blocks + recomputed_blocks  # forward + backward of every block, plus recomputation
    sums = passes * clip.sums_bytes(batch) * 2 * (degree - 1) // degree
    temporal_passes = 2 * clip.temporal_blocks + round(recomputed_blocks * clip.temporal_blocks / clip.blocks)
    sides = 1 if degree == 2 else 2  # a rank between two others sends both halos; the ends send one
    halos = temporal_passes * sides * clip.halo_bytes(batch, dtype_bytes)
    return sums + halos
