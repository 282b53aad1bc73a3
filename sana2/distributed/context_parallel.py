"""Context parallelism for Sana-Video: one clip's frames split over the ranks of a cp group, exactly.

Each rank of a cp group holds a contiguous run of the clip's (patch) frames, whole frames only. Of the
blocks' math, only three things look beyond a rank's own tokens, and the model routes each through a
hook whose default is the whole-sequence case (sana2/models/layers.py, sana_video.py):
- linear attention's sums over all tokens, sum phi(k) v^T [B, H, d, d] and sum phi(k) [B, H, d]:
  one all-reduce of a few kilobytes per head (`sequence_sums`); its backward all-reduces the
  gradient, so every rank's queries send their share of the gradient to every rank's keys and values;
- the temporal convolution (kernel k) of the video FFN: each rank needs k // 2 frames of each
  neighbour (`frame_halo`, a point-to-point exchange; the backward sends the halo's gradient back);
- the rotary embedding: a rank's frame positions start at its first frame (`first_frame`).
Cross-attention, norms, modulation, the per-frame GLUMBConv and the final layer act per token or per
frame. The image model's 3x3 depthwise convolution mixes rows and softmax attention needs all keys:
those models are refused (`check_model`).

The loss: each rank's per-sample mean squared error covers its frames only; `whole_sample_loss` weighs
it by the rank's share of the clip and all-reduces it, so every rank of the group holds the clip's
loss. Each rank's backward then yields degree x its share of the gradient, and FSDP's gradient mean
over the (data-parallel shard x cp) ranks divides by that degree again: the gradients equal those of
one rank holding the whole clip.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sana2.models.layers import LinearAttention
from sana2.models.sana_video import GLUMBConvTemp, PerFrameGLUMBConv, SanaMSVideo


class ContextParallelError(ValueError):
    """A model or clip that context parallelism cannot split."""


def frame_bounds(frames: int, degree: int, rank: int) -> tuple[int, int]:
    """[start, stop) of `frames` that `rank` of `degree` holds: contiguous runs whose lengths differ by
    at most one, the longer ones first (as torch.tensor_split)."""
    base, longer = divmod(frames, degree)
    start = rank * base + min(rank, longer)
    return start, start + base + (rank < longer)


@dataclass(frozen=True)
class FrameSplit:
    """The latent frames [start, stop) of a clip of `total` latent frames that one rank holds."""

    start: int
    stop: int
    total: int

    @property
    def share(self) -> float:
        """The fraction of the clip's tokens on this rank."""
        return (self.stop - self.start) / self.total

    def take(self, tensor: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """This rank's frames of `tensor` (frames on `dim`: 2 for latents [B, C, F, H, W])."""
        return tensor.narrow(dim, self.start, self.stop - self.start)


class ContextParallel:
    """The hooks and splits of one cp group (a process group of `degree` ranks, in frame order)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    # -- splitting the inputs -----------------------------------------------------------------------
    def split(self, latent_frames: int, patch_frames: int = 1, min_frames: int = 1) -> FrameSplit:
        """This rank's latent frames of a clip with `latent_frames`, cut between patches of
        `patch_frames`; every rank must get at least `min_frames` patch frames (the halo)."""
        frames = latent_frames // patch_frames
        if frames < self.degree * max(min_frames, 1):
            raise ContextParallelError(
                f"a clip of {frames} latent frames (after the patch) cannot be split over "
                f"context_parallel_degree={self.degree} ranks: each rank needs at least {max(min_frames, 1)} "
                f"frame(s); use a degree of at most {frames // max(min_frames, 1)} or longer clips"
            )
        start, stop = frame_bounds(frames, self.degree, self.rank)
        return FrameSplit(start * patch_frames, stop * patch_frames, latent_frames)

    def split_for(self, model: nn.Module, latent_frames: int) -> FrameSplit:
        """This rank's latent frames of a clip of `latent_frames` for `model` (cut between its patches,
        each rank keeping at least the temporal convolution's halo)."""
        return self.split(latent_frames, model.patch_size[0], min_frames_per_rank(model))

    def whole_sample_loss(self, local_loss: torch.Tensor, split: FrameSplit) -> torch.Tensor:
        """Per-sample losses [B] over the whole clip, from each rank's mean over its own frames."""
        return _AllReduceSum.apply(local_loss * split.share, self.group)

    def gather_frames(self, local: torch.Tensor, split: FrameSplit, dim: int = 2) -> torch.Tensor:
        """The whole clip from every rank's frames of it (no gradient: sampling and validation)."""
        bounds = [frame_bounds(split.total, self.degree, r) for r in range(self.degree)]
        shape = list(local.shape)
        shape[dim] = max(stop - start for start, stop in bounds)  # gloo gathers equal sizes only
        padded = local.new_zeros(shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        parts = [torch.empty_like(padded) for _ in range(self.degree)]
        dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([part.narrow(dim, 0, stop - start) for part, (start, stop) in zip(parts, bounds)], dim=dim)

    # -- the model's hooks ------------------------------------------------------------------------
    def sequence_sums(self, *sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Linear attention's sums over this rank's tokens -> over the clip's: one all-reduce for all."""
        flat = _AllReduceSum.apply(torch.cat([s.reshape(-1) for s in sums]), self.group)
        return tuple(part.view_as(s) for part, s in zip(flat.split([s.numel() for s in sums]), sums))

    def frame_halo(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        """x [B, D, F_local, N] with the neighbours' `frames` edge frames on each side (zeros at the
        clip's ends): what a temporal convolution sees at the rank's borders."""
        return _FrameHalo.apply(x, frames, self)

    def first_frame(self, frames: int) -> int:
        """The clip index of this rank's first frame: the frames of the ranks before it (one tiny
        all-gather, so any contiguous split of any clip is placed right)."""
        count = torch.tensor([frames], dtype=torch.int64)
        counts = [torch.empty_like(count) for _ in range(self.degree)]
        dist.all_gather(counts, count, group=self.group)
        return int(sum(c.item() for c in counts[: self.rank]))

    def swap_with_neighbours(
        self, to_previous: torch.Tensor, to_next: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send `to_previous` to rank - 1 and `to_next` to rank + 1; returns (what rank - 1 sent to its
        next, what rank + 1 sent to its previous), zeros where there is no neighbour."""
        from_previous, from_next = to_next.new_zeros(to_next.shape), to_previous.new_zeros(to_previous.shape)
        ops = []
        if self.rank > 0:
            ops += [
                dist.P2POp(dist.isend, to_previous.contiguous(), group=self.group, group_peer=self.rank - 1),
                dist.P2POp(dist.irecv, from_previous, group=self.group, group_peer=self.rank - 1),
            ]
        if self.rank < self.degree - 1:
            ops += [
                dist.P2POp(dist.isend, to_next.contiguous(), group=self.group, group_peer=self.rank + 1),
                dist.P2POp(dist.irecv, from_next, group=self.group, group_peer=self.rank + 1),
            ]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return from_previous, from_next


class _AllReduceSum(torch.autograd.Function):
    """The sum over the group's ranks; its gradient is the sum of every rank's gradient of the sum.

    (torch.distributed.nn.functional.all_reduce does the same, but is deprecated in favour of a
    private module.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllReduceSum.apply(grad, ctx.group), None


class _FrameHalo(torch.autograd.Function):
    """[previous rank's last frames | x | next rank's first frames] along dim 2; the backward returns
    each halo's gradient to the rank whose frames it was."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, frames: int, cp: ContextParallel) -> torch.Tensor:
        ctx.frames, ctx.cp = frames, cp
        if frames == 0:
            return x
        left, right = cp.swap_with_neighbours(x[:, :, :frames], x[:, :, -frames:])
        return torch.cat([left, x, right], dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        frames, cp = ctx.frames, ctx.cp
        if frames == 0:
            return grad, None, None
        local = grad.shape[2] - 2 * frames
        grad_left, grad_x, grad_right = grad.split([frames, local, frames], dim=2)
        # my left halo was the previous rank's last frames: its gradient goes back there (and vice versa)
        from_previous, from_next = cp.swap_with_neighbours(grad_left, grad_right)
        grad_x = grad_x.clone()
        grad_x[:, :, :frames] += from_previous
        grad_x[:, :, -frames:] += from_next
        return grad_x, None, None


def check_model(model: nn.Module) -> None:
    """Raise ContextParallelError unless every block of `model` can run on a rank's frames exactly."""
    name = type(model).__name__
    if not isinstance(model, SanaMSVideo):
        raise ContextParallelError(
            f"context parallelism splits a clip's frames over ranks; {name} is an image model (its 3x3 "
            f"depthwise convolution mixes rows, and its attention may be softmax over all tokens): set [parallelism] "
            f"context_parallel_degree = 1, or train a video model (SanaMSVideo)"
        )
    for index, block in enumerate(model.blocks):
        if not isinstance(block.attn, LinearAttention):
            raise ContextParallelError(
                f"context parallelism needs linear self-attention; block {index} of {name} has "
                f"{type(block.attn).__name__} (softmax needs every token's keys): use attn_type "
                f"'LiteLAReLURope' or 'linear', or set [parallelism] context_parallel_degree = 1"
            )
        if not isinstance(block.mlp, PerFrameGLUMBConv):
            raise ContextParallelError(f"context parallelism cannot split block {index}'s {type(block.mlp).__name__}")


def min_frames_per_rank(model: nn.Module) -> int:
    """The fewest patch frames a rank may hold: the temporal convolution's halo (at least one frame)."""
    halos = [block.mlp.halo_frames for block in model.blocks if isinstance(block.mlp, GLUMBConvTemp)]
    return max([1, *halos])


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> nn.Module:
    """Install cp's hooks in `model` (checked first; in place, returned). The math is unchanged: the
    hooks only make each rank's sums, halos and positions those of the whole clip."""
    check_model(model)
    model.first_frame = cp.first_frame
    for block in model.blocks:
        block.attn.sequence_sums = cp.sequence_sums
        if isinstance(block.mlp, GLUMBConvTemp):
            block.mlp.frame_halo = cp.frame_halo
    return model


class WholeClipForward:
    """`model` called on whole clips, computed split: each rank runs its own frames and the output's
    frames are gathered, so every rank returns the whole clip's prediction (sampling and validation,
    no gradient). Everything else is the model's."""

    def __init__(self, model: nn.Module, cp: ContextParallel):
        self.model, self.cp = model, cp

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        split = self.cp.split_for(self.model, x.shape[2])
        return self.cp.gather_frames(self.model(split.take(x), *args, **kwargs), split)

    def __getattr__(self, name: str):
        return getattr(self.model, name)
