"""Tiny clips for the tests, written with PyAV: frame i is a flat grey of level `level(i)`, so a decoded frame
says which source frame it is (H.264 keeps a flat frame within a few levels)."""

from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def level(index: int) -> int:
    return (8 * index + 16) % 240


def write_test_clip(path, frames: int = 12, fps: float = 16, width: int = 48, height: int = 32) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264" if path.suffix != ".webm" else "libvpx-vp9", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            array = np.full((height, width, 3), level(index), dtype=np.uint8)
            array[: height // 4, : width // 4] = 255 - level(index)  # not symmetric: a crop shows
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def tiny_wan_vae(path, z_dim: int = 4) -> Path:
    """A tiny AutoencoderKLWan (random weights, Wan 2.1's 4x time / 8x space layout) saved to `path`."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    model = AutoencoderKLWan(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * (i - z_dim / 2) for i in range(z_dim)],
        latents_std=[1.0 + 0.25 * i for i in range(z_dim)],
    )
    model.save_pretrained(path)
    return Path(path)
