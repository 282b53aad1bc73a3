"""What online mode's VAE holds while it encodes one micro-batch: its live activations, from its config alone.

`[data] mode = "online"` encodes each micro-batch's images or clips on the training rank before the step
(sana2/data/online.py), under no_grad: the pixels on the device, the encoder's largest set of live
activations, and the latents. The encoder is built from the folder's config.json on the meta device and
run there exactly as online mode runs it (sana2/encoders/autoencoder.py's `configured_autoencoder`: DC-AE
and KL in [encoding] dtype, the whole batch at once; the Wan VAE in float32, one clip at a time, in tiles
with encoding.vae_tiling), while `LiveBytes(meta=True)` counts the bytes of every tensor it creates and
frees: the real run's live tensor bytes, with nothing computed or allocated. Kernels' internal
workspaces (cuDNN's) are not tensors and are not counted. Attention (KL's and Wan's middle blocks) runs
as a fused kernel on GPUs and CPUs alike (flash or memory-efficient: no score matrix held); on the meta
device torch would take the math path and hold the scores, so there `FusedAttention` stands in its
outputs instead.

A batch of one and of two are run; more samples add what the second added (the encoders are linear in
the batch: DC-AE and KL hold each sample's activations side by side; the Wan VAE's slices add one clip's
pixels and latents each). Meta kernels are slow Python, and the Wan VAE runs its encoder once per chunk of
4 frames (its causal cache carried over): from the third chunk on each chunk adds the same bytes (its
pixels and latents), so a long clip is run at 9 and 13 frames and the rest extrapolated chunk by chunk.
"""

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from sana2.encoders.autoencoder import autoencoder_class, autoencoder_dtype, configured_autoencoder
from sana2.planning.live_bytes import LiveBytes

CHUNK = 4  # the Wan VAE's frames per encoder call after the first frame
LINEAR_FROM = 9  # frames from which each further chunk adds the same bytes


@dataclass(frozen=True)
class EncodeCost:
    """Peak live bytes of the VAE's encode of a batch: `first` for one sample, plus `each` per further one."""

    first: int
    each: int
    what: str  # e.g. "AutoencoderDC at 1024x1024, bfloat16"

    def at(self, batch: int) -> int:
        return self.first + (batch - 1) * self.each


class FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention as a fused kernel leaves it: the output and the row log-sum-exps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, value = args[0], args[2] if len(args) > 2 else kwargs["value"]
        output = query.new_empty((*query.shape[:-1], value.shape[-1]))
        log_sum_exp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        del log_sum_exp
        return output


def encode_peak(vae, batch: int, height: int, width: int, frames: int | None = None) -> int:
    """Peak live tensor bytes of `vae.encode_on_device` of `batch` images (or `frames`-frame clips), the
    pixels on the VAE's device included, `vae` on the meta device."""
    shape = (batch, 3, height, width) if frames is None else (batch, 3, frames, height, width)
    with FusedAttention(), LiveBytes(meta=True) as live:
        pixels = torch.zeros(shape, device=vae.device, dtype=vae.dtype)  # the batch copied to the device
        latents = vae.encode_on_device(pixels)
        del pixels, latents
    return live.peak


def vae_encode_cost(encoding, height: int, width: int, frames: int | None = None) -> EncodeCost:
    """The encode cost of [encoding]'s VAE (a local diffusers folder) on `height` x `width` images, or clips of
    `frames` frames, built on meta from its config.json."""
    return _encode_cost(encoding.vae, encoding.dtype, encoding.vae_tiling, height, width, frames)


@functools.lru_cache(maxsize=16)  # a plan's suggestions and a test's several plans ask for the same one
def _encode_cost(folder: str, dtype_name: str, tiling: bool, height: int, width: int, frames: int | None):
    model_class = autoencoder_class(Path(folder))
    dtype = autoencoder_dtype(model_class, getattr(torch, dtype_name))
    config = model_class.load_config(folder, local_files_only=True)
    with torch.device("meta"):
        model = model_class.from_config(config)
    if dtype != torch.float32:
        model = model.to(dtype)
    vae = configured_autoencoder(model, "meta", keep_decoder=False, tiling=tiling)
    if frames is None or frames <= LINEAR_FROM + CHUNK:
        one, two = (encode_peak(vae, batch, height, width, frames) for batch in (1, 2))
    else:  # a long clip: two measured lengths, then what each further chunk of frames adds
        chunks = (frames - LINEAR_FROM) // CHUNK
        one, two = (
            short + chunks * (longer - short)
            for short, longer in (
                [encode_peak(vae, batch, height, width, length) for length in (LINEAR_FROM, LINEAR_FROM + CHUNK)]
                for batch in (1, 2)
            )
        )
    size = f"{height}x{width}" + (f", {frames} frames" if frames else "")
    return EncodeCost(one, two - one, f"{model_class.__name__} at {size}, {str(dtype).removeprefix('torch.')}")
