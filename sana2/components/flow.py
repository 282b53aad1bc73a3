"""Rectified flow ("linear_flow"), as ARCHITECTURE.md's training objective defines it.

x_t = (1 - sigma) x0 + sigma * noise, target v = noise - x0, the model sees floor(1000 * sigma).
"""

import torch

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


def sampling_sigmas(steps: int, shift: float) -> torch.Tensor:
    """Euler sampling schedule from sigma 1 to 0 (steps + 1 values), shifted like training."""
    return shift_sigma(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)
