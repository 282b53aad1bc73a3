"""The Wan 2.1 video autoencoder (diffusers' `AutoencoderKLWan`) with Sana-Video's latent normalisation.

Wan 2.1 maps a clip of 4k + 1 frames [B, 3, 4k + 1, H, W] in [-1, 1] to latents [B, 16, k + 1, H / 8, W / 8]
(the first frame alone, then every 4 frames). Its latents are normalised per channel with the config's
`latents_mean` / `latents_std`: (z - mean) / std on the way in, and on the way out exactly as diffusers'
SanaVideoPipeline undoes it (latents / (1 / std) + mean, in the VAE's dtype). The encoder gives the
posterior's mean (Sana's vae_encode takes it), or a seeded sample with one generator per clip.

An image is a one-frame clip: [B, 3, H, W] encodes to [B, 16, 1, H / 8, W / 8] (Sana-Video's image-video
joint training encodes its images so). Sana runs the Wan VAE in float32 (its configs' `weight_dtype`), the
default here. Batches are encoded one clip at a time (diffusers' slicing: the same numbers, a clip's memory);
`tiling=True` also splits each frame into overlapping tiles, for clips whose activations do not fit.
"""

import torch
from torch import nn


class WanAutoencoder:
    """A frozen AutoencoderKLWan with per-channel latent normalisation; the Autoencoder interface for video."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu", tiling: bool = False):
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        config = model.config
        self.latent_channels = int(config.z_dim)
        self.downsample = int(config.scale_factor_spatial)
        self.temporal_downsample = int(config.scale_factor_temporal)
        self.dtype = next(model.parameters()).dtype
        self.latents_mean = torch.tensor(config.latents_mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(config.latents_std, dtype=torch.float32).view(1, -1, 1, 1, 1)
        model.enable_slicing()
        if tiling:
            model.enable_tiling()

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, int, int, int]:
        """[C, T, h, w] of a clip of `frames` frames (an image: None or 1) of height x width pixels."""
        frames = 1 if frames is None else frames
        if height % self.downsample or width % self.downsample:
            raise ValueError(f"frame size {height}x{width} is not a multiple of the VAE's factor {self.downsample}")
        if frames < 1 or (frames - 1) % self.temporal_downsample:
            raise ValueError(f"{frames} frames: the Wan VAE takes {self.temporal_downsample}k + 1 frames")
        latent_frames = (frames - 1) // self.temporal_downsample + 1
        return self.latent_channels, latent_frames, height // self.downsample, width // self.downsample

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """float32 normalised latents [B, C, T', h, w] of clips [B, 3, T, H, W] (or images [B, 3, H, W])."""
        if pixels.dim() == 4:
            pixels = pixels.unsqueeze(2)
        dist = self.model.encode(pixels.to(self.device, self.dtype)).latent_dist
        latents = dist.mean.float()
        if generators is not None:
            noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=g) for g in generators])
            latents = latents + dist.std.float() * noise.to(latents.device)
        mean, std = self.latents_mean.to(latents.device), self.latents_std.to(latents.device)
        return ((latents - mean) / std).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """float32 clips [B, 3, T, H, W] in [-1, 1] (clamped) of normalised latents [B, C, T', h, w]."""
        if getattr(self.model, "decoder", None) is None:
            raise RuntimeError("this autoencoder was loaded without its decoder (keep_decoder=False)")
        z = latents.to(self.device, self.dtype)
        mean = self.latents_mean.to(z.device, z.dtype)
        inverse_std = 1.0 / self.latents_std.to(z.device, z.dtype)
        z = z / inverse_std + mean  # as SanaVideoPipeline, so that both decode the same numbers
        return self.model.decode(z).sample.float().clamp(-1, 1).cpu()
