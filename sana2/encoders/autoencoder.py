"""The autoencoder: pixels in [-1, 1] <-> latents normalised as the diffusion model consumes them.

One interface for every VAE, images [B, 3, H, W] and videos [B, 3, T, H, W] alike: `encode(pixels)` gives
normalised float32 latents ([B, C, h, w] or [B, C, t, h, w]), `decode(latents)` the pixels back; each VAE
exposes its latent channels and its spatial and temporal compression factors.

Any diffusers autoencoder saved in a local folder (config.json naming its class in "_class_name", and its
weights) is loaded by that class, nothing downloaded:
  * image VAEs, which see one frame at a time (temporal compression 1; a video is encoded frame by frame):
    Sana's DC-AE (`AutoencoderDC`, f32c32: 32 latent channels, 32x smaller per side, scaling factor 0.41407)
    or a KL autoencoder (`AutoencoderKL`). Normalisation: one shift and one scaling factor,
    (z - shift_factor) * scaling_factor, as Sana scales them.
  * the Wan video VAE (`AutoencoderKLWan`, causal in time: T = 1 + 4k frames give 1 + k latent frames; an
    image is a one-frame video). Normalisation: per-channel means and standard deviations,
    (z - latents_mean) / latents_std, as the diffusers Wan pipelines normalise.
A KL posterior (KL, Wan) is reduced to its mean, or drawn from with one generator per sample.
"""

import json
from pathlib import Path

import torch
from torch import nn

# Sana's DC-AE f32c32 (mit-han-lab/dc-ae-f32c32-sana-1.x-diffusers), as an AutoencoderDC config: encoder and
# decoder mirror each other, three residual stages then three EfficientViT stages
_DC_AE_STAGES = ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3
_DC_AE_WIDTHS = (128, 256, 512, 512, 1024, 1024)
_DC_AE_ATTENTION_SCALES = ((), (), (), (5,), (5,), (5,))
DC_AE_F32C32_CONFIG = dict(
    in_channels=3,
    latent_channels=32,
    attention_head_dim=32,
    encoder_block_types=_DC_AE_STAGES,
    decoder_block_types=_DC_AE_STAGES,
    encoder_block_out_channels=_DC_AE_WIDTHS,
    decoder_block_out_channels=_DC_AE_WIDTHS,
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3),
    decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    encoder_qkv_multiscales=_DC_AE_ATTENTION_SCALES,
    decoder_qkv_multiscales=_DC_AE_ATTENTION_SCALES,
    upsample_block_type="interpolate",
    downsample_block_type="conv",
    decoder_norm_types="rms_norm",
    decoder_act_fns="silu",
    scaling_factor=0.41407,
)


class LatentNormalization:
    """z -> (z - shift) * scale and back, with scalars or per-channel [C] vectors (broadcast over dim 1)."""

    def __init__(self, shift: float | list[float], scale: float | list[float]):
        self.shift = torch.tensor(shift, dtype=torch.float32)
        self.scale = torch.tensor(scale, dtype=torch.float32)

    def _per_channel(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        value = value.to(like.device)
        return value.reshape(1, -1, *[1] * (like.ndim - 2)) if value.ndim else value

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self._per_channel(self.shift, z)) * self._per_channel(self.scale, z)

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self._per_channel(self.scale, latents) + self._per_channel(self.shift, latents)


def latent_normalization(model: nn.Module) -> LatentNormalization:
    """The VAE's own normalisation: Wan's per-channel statistics, or one scaling and shift factor."""
    config = model.config
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        return LatentNormalization(list(config.latents_mean), [1.0 / float(s) for s in config.latents_std])
    scale = float(config.scaling_factor) if config.get("scaling_factor") is not None else 1.0
    shift = float(config.shift_factor) if config.get("shift_factor") is not None else 0.0
    return LatentNormalization(shift, scale)


class Autoencoder:
    """A frozen diffusers autoencoder behind one interface for images and videos, with its normalisation."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu"):
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        self.normalization = latent_normalization(model)
        self.latent_channels = int(model.config.get("latent_channels") or model.config.z_dim)
        self.spatial_compression = _spatial_compression(model)
        # a video VAE takes [B, 3, T, H, W] and compresses time; an image VAE sees one frame at a time
        self.is_video = model.config.get("scale_factor_temporal") is not None
        self.temporal_compression = int(model.config.scale_factor_temporal) if self.is_video else 1
        self.dtype = next(model.parameters()).dtype

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """[C, h, w] of an image, or [C, t, h, w] of a `frames`-frame video."""
        factor = self.spatial_compression
        if height % factor or width % factor:
            raise ValueError(f"image size {height}x{width} is not a multiple of the VAE's factor {factor}")
        spatial = (height // factor, width // factor)
        if frames is None:
            return self.latent_channels, *spatial
        return self.latent_channels, self.latent_frames(frames), *spatial

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a `frames`-frame video: a causal video VAE keeps the first frame on its own."""
        if frames < 1:
            raise ValueError(f"a video has at least one frame, got {frames}")
        factor = self.temporal_compression
        if factor == 1:
            return frames
        if (frames - 1) % factor:
            raise ValueError(f"{frames} frames: this video VAE takes 1 + {factor}k frames (e.g. {1 + factor * 4})")
        return 1 + (frames - 1) // factor

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Normalised float32 latents of pixels in [-1, 1]: [B, 3, H, W] -> [B, C, h, w] and
        [B, 3, T, H, W] -> [B, C, t, h, w].

        A KL posterior gives its mean, or, with one generator per sample, a sample drawn from it.
        """
        video = _check_pixels(pixels)
        batch = pixels.shape[0]
        x = self._to_model_layout(pixels.to(self.device, self.dtype), video)
        output = self.model.encode(x)
        if hasattr(output, "latent_dist"):
            dist = output.latent_dist
            latents = self._from_model_layout(dist.mean, batch, video)
            if generators is not None:
                if len(generators) != batch:
                    raise ValueError(f"{len(generators)} generators for a batch of {batch}")
                std = self._from_model_layout(dist.std, batch, video)
                noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in generators])
                latents = latents + std * noise.to(latents.device, latents.dtype)
        else:
            latents = self._from_model_layout(output.latent, batch, video)
        return self.normalization.normalise(latents.float()).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """float32 pixels in [-1, 1] (clamped) of normalised latents: [B, C, h, w] -> [B, 3, H, W] and
        [B, C, t, h, w] -> [B, 3, T, H, W]."""
        if getattr(self.model, "decoder", None) is None:
            raise RuntimeError("this autoencoder was loaded without its decoder (keep_decoder=False)")
        if latents.ndim not in (4, 5):
            raise ValueError(f"latents are [B, C, h, w] or [B, C, t, h, w], got shape {tuple(latents.shape)}")
        video = latents.ndim == 5
        z = self.normalization.denormalise(latents.to(self.device, torch.float32))
        decoded = self.model.decode(self._to_model_layout(z.to(self.dtype), video)).sample
        return self._from_model_layout(decoded, latents.shape[0], video).float().clamp(-1, 1).cpu()

    def _to_model_layout(self, x: torch.Tensor, video: bool) -> torch.Tensor:
        """What the diffusers model takes: an image VAE frames [B*T, c, H, W], a video VAE [B, c, T, H, W]."""
        if self.is_video:
            return x if video else x.unsqueeze(2)
        return x.transpose(1, 2).flatten(0, 1) if video else x

    def _from_model_layout(self, x: torch.Tensor, batch: int, video: bool) -> torch.Tensor:
        if self.is_video:
            return x if video else x.squeeze(2)
        return x.unflatten(0, (batch, -1)).transpose(1, 2) if video else x


def _check_pixels(pixels: torch.Tensor) -> bool:
    """True for a video batch [B, 3, T, H, W], False for images [B, 3, H, W]."""
    if pixels.ndim not in (4, 5) or pixels.shape[1] != 3:
        raise ValueError(f"pixels are [B, 3, H, W] or [B, 3, T, H, W], got shape {tuple(pixels.shape)}")
    return pixels.ndim == 5


def _spatial_compression(model: nn.Module) -> int:
    ratio = getattr(model, "spatial_compression_ratio", None)  # AutoencoderDC, AutoencoderKLWan
    if ratio is None:  # AutoencoderKL and its kin halve the size between consecutive blocks
        ratio = 2 ** (len(model.config.block_out_channels) - 1)
    return int(ratio)


def build_autoencoder(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_decoder: bool = True,
) -> Autoencoder:
    """Load the diffusers autoencoder saved in the local folder `path` (nothing is downloaded).

    `keep_decoder=False` frees the decoder after loading (precomputation only encodes; DC-AE's decoder
    is the larger half).
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"VAE {str(path)!r}: no config.json there (expected a local diffusers autoencoder folder, e.g. "
            "dc-ae-f32c32-sana-1.1-diffusers; nothing is downloaded)"
        )
    import diffusers

    class_name = json.loads(config_file.read_text()).get("_class_name")
    model_class = getattr(diffusers, str(class_name), None)
    if model_class is None or not class_name.startswith("Autoencoder"):
        raise ValueError(
            f"{config_file}: '_class_name' is {class_name!r}; expected a diffusers autoencoder class such as "
            "'AutoencoderDC', 'AutoencoderKL' or 'AutoencoderKLWan'"
        )
    model = model_class.from_pretrained(path, local_files_only=True, torch_dtype=dtype)
    if not keep_decoder:
        model.decoder = None
    return Autoencoder(model.to(device), device)
