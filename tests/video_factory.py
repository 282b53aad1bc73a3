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
