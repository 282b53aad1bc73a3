"""Rectified flow ("linear_flow"), the training objective (docs/model.md, "Training objective").

x_t = (1 - sigma) x0 + sigma * noise, target v = noise - x0, the model sees floor(1000 * sigma);
the loss of a sample is the mean squared error of its v-prediction.

`FlowMatching` owns the loss and its per-sample randomness: a sample's noise level, noise and
caption-dropout decision come from a generator seeded by (seed, step, sample index), so no world
size, batch split or resume changes them. Training and the held-out validation loss both use it.
"""

from dataclasses import dataclass

import torch
from torch import nn

from sana2.distributed.context_parallel import ContextParallel
from sana2.seeding import seeded_generator

NUM_TRAIN_TIMESTEPS = 1000


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The resolution-dependent flow shift: sigma' = s sigma / (1 + (s - 1) sigma)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def sample_sigmas(num: int, shift: float, mean: float, std: float, generator: torch.Generator | None = None):
    """Logit-normal u -> t_idx = floor(1000 u) -> sigma = t_idx / 1000 -> shifted sigma (float64)."""
    u = torch.sigmoid(torch.randn(num, generator=generator, dtype=torch.float64) * std + mean)
    t_idx = torch.floor(u * NUM_TRAIN_TIMESTEPS)
    return shift_sigma(t_idx / NUM_TRAIN_TIMESTEPS, shift)


def model_timestep(sigma: torch.Tensor) -> torch.Tensor:
    """The integer timestep the model receives for noise level sigma."""
    return torch.floor(sigma * NUM_TRAIN_TIMESTEPS).long()


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_t, v-target) for per-sample sigma [B]."""
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise, noise - x0


@dataclass
class Draw:
    """The randomness of a batch: sigma [B] (float64), noise [B, *latent], drop [B] bool (or None)."""

    sigma: torch.Tensor
    noise: torch.Tensor
    drop: torch.Tensor | None = None

    def to(self, device: torch.device) -> "Draw":
        """On `device`, copied without waiting for it (the host keeps its own draw, not changed in place)."""
        drop = None if self.drop is None else self.drop.to(device, non_blocking=True)
        return Draw(self.sigma.to(device, non_blocking=True), self.noise.to(device, non_blocking=True), drop)


class FlowMatching:
    """The rectified-flow loss with noise levels ~ shift(logit-normal(logit_mean, logit_std)) and
    captions dropped with probability caption_dropout."""

    def __init__(
        self,
        seed: int,
        shift: float = 1.0,
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        caption_dropout: float = 0.0,
    ):
        self.seed = seed
        self.shift = shift
        self.logit_mean = logit_mean
        self.logit_std = logit_std
        self.caption_dropout = caption_dropout

    @classmethod
    def from_config(cls, training) -> "FlowMatching":
        """From the [training] section."""
        return cls(
            training.seed, training.flow_shift, training.logit_mean, training.logit_std, training.caption_dropout
        )

    def draw(self, step: int, indices: torch.Tensor, shape: tuple[int, ...]) -> Draw:
        """Each sample's sigma, caption-drop decision and noise of `shape`, for sample ids `indices`."""
        sigmas, drops, noises = [], [], []
        for index in indices.tolist():
            generator = seeded_generator("sample", self.seed, step, index)
            sigmas.append(sample_sigmas(1, self.shift, self.logit_mean, self.logit_std, generator))
            drops.append(torch.rand(1, generator=generator) < self.caption_dropout)
            noises.append(torch.randn(shape, generator=generator))
        return Draw(torch.cat(sigmas), torch.stack(noises), torch.cat(drops))

    def draw_at(self, sigma: float, key: int, indices: torch.Tensor, shape: tuple[int, ...]) -> Draw:
        """Noise for evaluating at one fixed noise level `sigma`, no caption dropout; `key` tells the
        levels apart (it takes the place of the step)."""
        noises = [torch.randn(shape, generator=seeded_generator("sample", self.seed, key, i)) for i in indices.tolist()]
        return Draw(torch.full((len(noises),), sigma, dtype=torch.float64), torch.stack(noises))

    def loss(
        self, model: nn.Module, batch: dict[str, torch.Tensor], draw: Draw, cp: ContextParallel | None = None
    ) -> torch.Tensor:
        """Per-sample loss [B] (float32): the MSE of the model's v-prediction for `batch`'s latents
        [B, C, ...], caption_embeds [B, 1, L, C_cap] and caption_mask [B, L], noised by `draw`.

        With `cp` (context parallelism), every rank of the cp group gets the same whole clips and draw,
        computes its own frames, and returns the whole clips' losses."""
        x0, noise = batch["latents"], draw.noise.to(batch["latents"].dtype)
        split = cp.split_for(model, x0.shape[2]) if cp is not None else None
        if split is not None:
            x0, noise = split.take(x0), split.take(noise)
        x_t, target = noised(x0, noise, draw.sigma)
        prediction = model(
            x_t, model_timestep(draw.sigma), batch["caption_embeds"], batch["caption_mask"], drop_ids=draw.drop
        )
        per_sample = (prediction.float() - target.float()).pow(2).flatten(1).mean(1)
        return per_sample if split is None else cp.whole_sample_loss(per_sample, split)
