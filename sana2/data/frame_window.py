"""Which frames a clip contributes (`FrameWindow`), and the error of a clip that cannot be used.

A leaf module (no decoder, no torch): the config checks a window's settings with it; decoding is
sana2/data/video_decode.py's.
"""

import math
from dataclasses import dataclass
from fractions import Fraction

START_MODES = ("first", "center")


class BadVideo(ValueError):
    """A clip that cannot be used; the message says why."""


@dataclass(frozen=True)
class FrameWindow:
    """Which frames a clip contributes: `num_frames` at `fps`, starting `start` ("first" or "center")."""

    num_frames: int = 81
    fps: float = 16.0
    start: str = "first"

    def __post_init__(self):
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            raise ValueError(f"num_frames must be 4k + 1 (1, 5, ..., 81), got {self.num_frames}")
        if not self.fps > 0:
            raise ValueError(f"fps must be positive, got {self.fps}")
        if self.start not in START_MODES:
            raise ValueError(f"start must be one of {START_MODES}, got {self.start!r}")

    def resampled_length(self, frames: int, source_fps: float) -> int:
        """Frames of a `frames`-frame clip at `source_fps` once resampled to this window's rate."""
        if frames < 1:
            return 0
        # target frame i shows source frame floor(i * source_fps / fps); the last usable i keeps it < frames
        return math.floor((frames - 1) * self.fps / source_fps + 1e-9) + 1

    def source_indices(self, frames: int, source_fps: float) -> list[int]:
        """The source frame index of each of the window's frames; BadVideo if the clip is too short."""
        available = self.resampled_length(frames, source_fps)
        if available < self.num_frames:
            raise BadVideo(
                f"too short: {frames} frames at {source_fps:g} fps give {available} frames at {self.fps:g} fps, "
                f"{self.num_frames} needed"
            )
        first = 0 if self.start == "first" else (available - self.num_frames) // 2
        ratio = Fraction(source_fps).limit_denominator(1001 * 1000) / Fraction(self.fps).limit_denominator(1000)
        return [math.floor((first + i) * ratio) for i in range(self.num_frames)]
