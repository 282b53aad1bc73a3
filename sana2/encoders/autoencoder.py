"""The autoencoder: pixels in [-1, 1] <-> latents normalised as the diffusion model consumes them.

One interface for every VAE, images [B, 3, H, W] and videos [B, 3, T, H, W] alike: `encode(pixels)` gives
normalised float32 latents, `decode(latents)` the pixels back; each VAE exposes its latent channels, its
spatial and temporal compression factors and its own normalisation. Any diffusers autoencoder saved in a
local folder (config.json naming its class in "_class_name", and its weights) is loaded by that class,
nothing downloaded:
  * image VAEs see one frame at a time (temporal compression 1; a video is encoded frame by frame):
    Sana's DC-AE (`AutoencoderDC`, f32c32: 32 latent channels, 32x smaller per side, scaling factor 0.41407)
    or a KL autoencoder (`AutoencoderKL`). Normalisation: one shift and one scaling factor,
    (z - shift_factor) * scaling_factor, as Sana scales them. Images give [B, C, h, w].
  * Wan 2.1's video VAE (`AutoencoderKLWan`) maps 4k + 1 frames to k + 1 latent frames (the first frame
    alone, then every 4), 8x smaller per side. Normalisation: per channel, (z - latents_mean) / latents_std,
    undone exactly as diffusers' SanaVideoPipeline does (latents / (1 / std) + mean). An image is a
    one-frame clip, [B, 3, H, W] -> [B, C, 1, h, w], as Sana-Video's image-video joint training encodes it.
    Sana runs it in float32 (its configs' `weight_dtype`), whatever dtype is asked; clips are encoded one at
    a time (diffusers' slicing: the same numbers, a clip's memory), and `tiling=True` also splits frames
    into overlapping tiles, for clips whose activations do not fit.
A KL posterior (KL, Wan) is reduced to its mean, or drawn from with one generator per sample.
"""

import json
from pathlib import Path

import torch
from torch import nn

from sana2.cli import CONFIG_JSON

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


class ScaleShift:
    """One shift and one scaling factor for every channel: z -> (z - shift) * scale (DC-AE, KL)."""

    def __init__(self, shift: float, scale: float):
        self.shift, self.scale = shift, scale

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self.shift) * self.scale

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / self.scale + self.shift


class PerChannel:
    """Per-channel statistics: z -> (z - mean) / std, broadcast over dim 1 (Wan)."""

    def __init__(self, mean: list[float], std: list[float]):
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)

    def _channels(self, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return value.to(like.device, like.dtype).reshape(1, -1, *[1] * (like.ndim - 2))

    def normalise(self, z: torch.Tensor) -> torch.Tensor:
        return (z - self._channels(self.mean, z)) / self._channels(self.std, z)

    def denormalise(self, latents: torch.Tensor) -> torch.Tensor:
        inverse_std = 1.0 / self._channels(self.std, latents)  # as SanaVideoPipeline: both decode the same numbers
        return latents / inverse_std + self._channels(self.mean, latents)


def latent_normalization(model: nn.Module) -> ScaleShift | PerChannel:
    """The VAE's own normalisation: per-channel means and stds where its config has them, else its factors."""
    config = model.config
    if config.get("latents_mean") is not None and config.get("latents_std") is not None:
        return PerChannel(list(config.latents_mean), list(config.latents_std))
    scale = float(config.scaling_factor) if config.get("scaling_factor") is not None else 1.0
    shift = float(config.shift_factor) if config.get("shift_factor") is not None else 0.0
    return ScaleShift(shift, scale)


class Autoencoder:
    """A frozen diffusers autoencoder behind one interface for images and videos, with its normalisation."""

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu"):
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        config = model.config
        self.normalization = latent_normalization(model)
        self.latent_channels = latent_channels(config)
        self.spatial_compression = _spatial_compression(model)
        # a video VAE takes [B, 3, T, H, W] and compresses time; an image VAE sees one frame at a time
        self.is_video = config.get("scale_factor_temporal") is not None
        self.temporal_compression = int(config.scale_factor_temporal) if self.is_video else 1
        self.dtype = next(model.parameters()).dtype

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """[C, h, w] of an image ([C, 1, h, w] from a video VAE), or [C, t, h, w] of a `frames`-frame clip."""
        factor = self.spatial_compression
        if height % factor or width % factor:
            raise ValueError(f"frame size {height}x{width} is not a multiple of the VAE's factor {factor}")
        spatial = (height // factor, width // factor)
        if frames is None and not self.is_video:
            return self.latent_channels, *spatial
        return self.latent_channels, self.latent_frames(1 if frames is None else frames), *spatial

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a `frames`-frame clip: a video VAE keeps the first frame on its own."""
        factor = self.temporal_compression
        if frames < 1 or (frames - 1) % factor:
            raise ValueError(f"{frames} frames: this VAE takes {factor}k + 1 frames")
        return 1 + (frames - 1) // factor

    def encode(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """Normalised float32 latents of pixels in [-1, 1], on the CPU: images [B, 3, H, W] -> [B, C, h, w] (a
        video VAE: [B, C, 1, h, w]), clips [B, 3, T, H, W] -> [B, C, t, h, w].

        A KL posterior gives its mean, or, with one generator per sample, a sample drawn from it.
        """
        return self.encode_on_device(pixels, generators).cpu()

    @torch.no_grad()
    def encode_on_device(self, pixels: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
        """As `encode`, the latents left on the VAE's device (what the memory plan runs on the meta device)."""
        clip = _is_clip(pixels)
        batch = pixels.shape[0]
        output = self.model.encode(self._frames_in(pixels.to(self.device, self.dtype), clip))
        if hasattr(output, "latent_dist"):
            dist = output.latent_dist
            latents = self._frames_out(dist.mean, batch, clip)
            if generators is not None:
                if len(generators) != batch:
                    raise ValueError(f"{len(generators)} generators for a batch of {batch}")
                std = self._frames_out(dist.std, batch, clip)
                noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in generators])
                latents = latents + std * noise.to(latents.device, latents.dtype)
        else:
            latents = self._frames_out(output.latent, batch, clip)
        return self.normalization.normalise(latents.float())

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """float32 pixels in [-1, 1] (clamped) of normalised latents: [B, C, h, w] -> [B, 3, H, W],
        [B, C, t, h, w] -> [B, 3, T, H, W]."""
        if getattr(self.model, "decoder", None) is None:
            raise RuntimeError("this autoencoder was loaded without its decoder (keep_decoder=False)")
        if latents.ndim not in (4, 5):
            raise ValueError(f"latents are [B, C, h, w] or [B, C, t, h, w], got shape {tuple(latents.shape)}")
        clip = latents.ndim == 5
        z = self.normalization.denormalise(latents.to(self.device, torch.float32))
        decoded = self.model.decode(self._frames_in(z.to(self.dtype), clip)).sample
        return self._frames_out(decoded, latents.shape[0], clip).float().clamp(-1, 1).cpu()

    def _frames_in(self, x: torch.Tensor, clip: bool) -> torch.Tensor:
        """What the diffusers model takes: a video VAE [B, c, T, H, W] (an image: T = 1), an image VAE
        [B, c, H, W] (a clip's frames side by side in the batch: [B * T, c, H, W])."""
        if self.is_video:
            return x if clip else x.unsqueeze(2)
        return x.transpose(1, 2).flatten(0, 1) if clip else x

    def _frames_out(self, x: torch.Tensor, batch: int, clip: bool) -> torch.Tensor:
        if self.is_video or not clip:
            return x
        return x.unflatten(0, (batch, -1)).transpose(1, 2)


def _is_clip(pixels: torch.Tensor) -> bool:
    """True for a video batch [B, 3, T, H, W], False for images [B, 3, H, W]."""
    if pixels.ndim not in (4, 5) or pixels.shape[1] != 3:
        raise ValueError(f"pixels are [B, 3, H, W] or [B, 3, T, H, W], got shape {tuple(pixels.shape)}")
    return pixels.ndim == 5


def _spatial_compression(model: nn.Module) -> int:
    ratio = getattr(model, "spatial_compression_ratio", None)  # AutoencoderDC, AutoencoderKLWan
    if ratio is None:  # AutoencoderKL and its kin halve the size between consecutive blocks
        ratio = 2 ** (len(model.config.block_out_channels) - 1)
    return int(ratio)


def latent_channels(config) -> int:
    """The latent channels a diffusers autoencoder config gives: `latent_channels` (DC-AE, KL), else `z_dim` (Wan)."""
    return int(config["latent_channels"] if config.get("latent_channels") else config["z_dim"])


def folder_latent_channels(path: str | Path) -> int:
    """The latent channels of the autoencoder in the local folder `path`, from its config.json alone (no weights
    read): what a run checks against its model before it starts."""
    autoencoder_class(Path(path))  # the folder holds a diffusers autoencoder config
    config_file = Path(path) / CONFIG_JSON
    try:
        return latent_channels(json.loads(config_file.read_text()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{config_file}: no latent_channels (or z_dim) in it: {exc}") from None


def autoencoder_class(path: Path) -> type:
    """The diffusers autoencoder class that the local folder `path`'s config.json names."""
    config_file = path / CONFIG_JSON
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
    return model_class


def is_wan(model_class: type) -> bool:
    """The Wan VAE, which runs in float32 whatever the configured dtype (as Sana runs it; its bf16 latents drift)."""
    return model_class.__name__ == "AutoencoderKLWan"


def build_autoencoder(
    path: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_decoder: bool = True,
    tiling: bool = False,
) -> Autoencoder:
    """Load the diffusers autoencoder saved in the local folder `path` (nothing is downloaded).

    `keep_decoder=False` frees the decoder after loading (precomputation only encodes; DC-AE's decoder
    is the larger half). The Wan VAE runs in float32 whatever `dtype` says (as Sana runs it; its bfloat16
    latents drift), one clip at a time, and `tiling` splits its frames into tiles.
    """
    path = Path(path)
    model_class = autoencoder_class(path)
    model = model_class.from_pretrained(path, local_files_only=True, torch_dtype=autoencoder_dtype(model_class, dtype))
    return configured_autoencoder(model, device, keep_decoder, tiling)


def autoencoder_dtype(model_class: type, dtype: torch.dtype) -> torch.dtype:
    """The dtype a VAE runs in: float32 for the Wan VAE, else the one asked for."""
    return torch.float32 if is_wan(model_class) else dtype


def configured_autoencoder(
    model: nn.Module, device: torch.device | str, keep_decoder: bool = True, tiling: bool = False
) -> Autoencoder:
    """`model` as build_autoencoder runs it: its decoder freed unless kept; the Wan VAE one clip at a time,
    in tiles with `tiling`."""
    if not keep_decoder:
        model.decoder = None
    if is_wan(type(model)):
        model.enable_slicing()
        if tiling:
            model.enable_tiling()
    return Autoencoder(model.to(device), device)
