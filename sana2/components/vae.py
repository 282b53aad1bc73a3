"""The image autoencoder: pixels in [-1, 1] <-> latents as the diffusion model consumes them.

Any diffusers autoencoder saved in a local folder (config.json naming its class in "_class_name", and its
weights) is loaded by that class, nothing downloaded: Sana's DC-AE (`AutoencoderDC`, f32c32: 32 latent
channels, 32x smaller per side, scaling factor 0.41407), or a KL autoencoder (`AutoencoderKL`, whose
posterior is reduced to its mean, or drawn from with a per-sample generator). Latents are scaled as Sana
scales them: (z - shift_factor) * scaling_factor on the way in, the inverse on the way out. Wan 2.1's video
autoencoder (`AutoencoderKLWan`) is loaded the same way and normalised per channel (sana2/components/wan_vae.py).
"""

import json
from pathlib import Path

import torch
from torch import nn

from sana2.components.wan_vae import WanAutoencoder

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


class Autoencoder:
    """A frozen diffusers autoencoder with Sana's latent scaling."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu"):
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        config = model.config
        self.scaling_factor = float(config.scaling_factor) if config.get("scaling_factor") is not None else 1.0
        self.shift_factor = float(config.shift_factor) if config.get("shift_factor") is not None else 0.0
        self.latent_channels = int(config.latent_channels)
        self.downsample = _spatial_compression(model)
        self.dtype = next(model.parameters()).dtype

    temporal_downsample = 1

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, int, int]:
        if frames is not None:
            raise ValueError(f"an image autoencoder encodes images, not {frames}-frame clips (a video needs Wan's)")
        if height % self.downsample or width % self.downsample:
            raise ValueError(f"image size {height}x{width} is not a multiple of the VAE's factor {self.downsample}")
        return self.latent_channels, height // self.downsample, width // self.downsample

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """float32 latents [B, C, h, w] of pixels [B, 3, H, W] in [-1, 1], scaled for the diffusion model.

        A KL posterior gives its mean, or, with one generator per sample, a sample drawn from it.
        """
        output = self.model.encode(pixels.to(self.device, self.dtype))
        if hasattr(output, "latent_dist"):
            dist = output.latent_dist
            latents = dist.mean
            if generators is not None:
                noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=g) for g in generators])
                latents = latents + dist.std * noise.to(latents.device, latents.dtype)
        else:
            latents = output.latent
        return ((latents.float() - self.shift_factor) * self.scaling_factor).cpu()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """float32 pixels [B, 3, H, W] in [-1, 1] (clamped) of scaled latents [B, C, h, w]."""
        if getattr(self.model, "decoder", None) is None:
            raise RuntimeError("this autoencoder was loaded without its decoder (keep_decoder=False)")
        z = latents.to(self.device, torch.float32) / self.scaling_factor + self.shift_factor
        return self.model.decode(z.to(self.dtype)).sample.float().clamp(-1, 1).cpu()


def _spatial_compression(model: nn.Module) -> int:
    ratio = getattr(model, "spatial_compression_ratio", None)  # AutoencoderDC
    if ratio is None:  # AutoencoderKL and its kin halve the size between consecutive blocks
        ratio = 2 ** (len(model.config.block_out_channels) - 1)
    return int(ratio)


def build_autoencoder(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_decoder: bool = True,
    tiling: bool = False,
) -> "Autoencoder | WanAutoencoder":
    """Load the diffusers autoencoder saved in the local folder `path` (nothing is downloaded).

    `keep_decoder=False` frees the decoder after loading (precomputation only encodes; DC-AE's decoder
    is the larger half). The Wan VAE runs in float32 whatever `dtype` says (as Sana runs it; its bfloat16
    latents drift), and `tiling` splits its frames into tiles.
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
            "'AutoencoderDC' or 'AutoencoderKL'"
        )
    wan = class_name == "AutoencoderKLWan"
    model = model_class.from_pretrained(path, local_files_only=True, torch_dtype=torch.float32 if wan else dtype)
    if not keep_decoder:
        model.decoder = None
    if wan:
        return WanAutoencoder(model.to(device), device, tiling=tiling)
    return Autoencoder(model.to(device), device)
