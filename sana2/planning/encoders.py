"""What online mode's frozen encoders hold on each rank: their weights, sized from the local folders' configs.

`[data] mode = "online"` encodes each step's captions with the text encoder and its images or clips with the
VAE's encoder on the training ranks. Both are built here on the meta device from their config.json alone (no
weights read, nothing allocated), exactly as sana2/data/shard_encoding.py loads them: the VAE without its decoder
(in float32 for the Wan VAE, else in [encoding] dtype), the text encoder in [encoding] dtype, whole on every rank or
sharded over the data-parallel ranks. What the VAE holds while it encodes is sana2/planning/vae_encode.py's; what
the text encoder holds, sana2/planning/text_encode.py's.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn

from sana2.encoders.autoencoder import autoencoder_class, autoencoder_dtype
from sana2.encoders.text_encoder import empty_text_encoder


@dataclass(frozen=True)
class EncoderWeights:
    """Online mode's encoder weights in bytes, as loaded (the text encoder unsharded)."""

    vae: int
    vae_dtype: str
    text_encoder: int
    text_encoder_dtype: str
    shard_text_encoder: bool

    def per_rank(self, data_parallel: int) -> int:
        """Bytes one of `data_parallel` ranks holds: the VAE whole, the text encoder whole or its 1/N share
        (FSDP's padding of each parameter to a multiple of N aside)."""
        shards = data_parallel if self.shard_text_encoder else 1
        return self.vae + -(-self.text_encoder // shards)


def _bytes(model: nn.Module, dtype: str, skip: str = "") -> int:
    itemsize = getattr(torch, dtype).itemsize
    return sum(p.numel() * itemsize for name, p in model.named_parameters() if not (skip and name.startswith(skip)))


def online_encoder_weights(encoding) -> EncoderWeights:
    """The weights of an [encoding] section's (sana2/config.py's Encoding) VAE and text encoder."""
    vae, vae_dtype = 0, encoding.dtype
    if encoding.vae != "none":
        model_class = autoencoder_class(Path(encoding.vae))
        vae_dtype = str(autoencoder_dtype(model_class, getattr(torch, encoding.dtype))).removeprefix("torch.")
        with init_empty_weights():
            model = model_class.from_config(model_class.load_config(encoding.vae, local_files_only=True))
        vae = _bytes(model, vae_dtype, skip="decoder.")  # online mode frees the decoder after loading
    model = empty_text_encoder(encoding.text_encoder, getattr(torch, encoding.dtype))
    model.tie_weights()  # built on the meta device, tied embeddings (T5's) are two until tied again
    text_encoder = _bytes(model, encoding.dtype)
    return EncoderWeights(vae, vae_dtype, text_encoder, encoding.dtype, encoding.shard_text_encoder)
