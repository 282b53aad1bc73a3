"""Video clips as Sana-Video feeds them to the Wan VAE: `num_frames` frames at a target frame rate, resized to
cover a bucket, centre-cropped, in [-1, 1], laid out [3, T, H, W].

Decoding is PyAV's (FFmpeg), an optional dependency (sana2[video]) imported where a clip is read or written:
training on prepared latents needs no FFmpeg. The clip's own rate (its stream's average frame rate) is resampled
to the target rate by picking, for each target time i / fps, the source frame on screen at that time (frame
floor(i * source_rate / fps)): a 30 fps clip at 16 fps keeps about every second frame, a 16 fps clip keeps
every frame, an 8 fps clip shows each frame twice. The window starts at a deterministic point of the resampled
clip: its first frame ("first", as Sana's zip dataset reads `frames[:num_frames]`) or the middle window
("center"). Each frame is resized and centre-cropped exactly as an image is (sana2/data/image.py).

Sana-Video trains on `num_frames = 4k + 1` frames (81 at 16 fps): the Wan VAE compresses time 4x after the
first frame. A clip that cannot be used raises BadVideo with the reason: not a video, unreadable, truncated
(fewer frames decoded than the window needs though the header promised them), or too short after resampling.
"""

import io
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sana2.data.frame_window import BadVideo, FrameWindow
from sana2.data.image import resize_and_crop

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")


@dataclass(frozen=True)
class ClipInfo:
    """What a clip's header says: its size, its frame rate and how many frames it has (estimated from the
    duration where the container does not count them)."""

    width: int
    height: int
    fps: float
    frames: int


def pyav():
    """The `av` module (PyAV), or an error that says how to install it."""
    try:
        import av
    except ImportError:
        raise ModuleNotFoundError("reading or writing video clips needs PyAV: pip install 'sana2[video]'") from None
    return av


def _open(data: bytes | str | Path):
    av = pyav()
    source = io.BytesIO(data) if isinstance(data, bytes) else str(data)
    try:
        container = av.open(source, mode="r")
    except av.error.InvalidDataError:
        raise BadVideo("not a video file FFmpeg can read") from None
    except (av.error.FFmpegError, OSError) as exc:
        raise BadVideo(f"unreadable video ({exc})") from None
    if not container.streams.video:
        container.close()
        raise BadVideo("not a video: the file has no video stream")
    return container


def _stream_info(stream) -> ClipInfo:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise BadVideo("unreadable video: no frame rate in the stream")
    fps = float(rate)
    frames = int(stream.frames or 0)
    if frames <= 0 and stream.duration is not None and stream.time_base is not None:
        frames = int(round(float(stream.duration * stream.time_base) * fps))
    if frames <= 0 and stream.container.duration is not None:
        frames = int(round(stream.container.duration / pyav().time_base * fps))
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise BadVideo(f"unreadable video: frame size {width}x{height}")
    return ClipInfo(width, height, fps, frames)


def probe(data: bytes | str | Path) -> ClipInfo:
    """The header of a clip (bytes, or a file path), without decoding frames."""
    container = _open(data)
    try:
        return _stream_info(container.streams.video[0])
    finally:
        container.close()


def decode_frames(data: bytes | str | Path, window: FrameWindow) -> tuple[list[Image.Image], ClipInfo]:
    """The window's frames of a clip as RGB images (repeated where the clip's rate is below the target rate)."""
    av = pyav()
    container = _open(data)
    try:
        stream = container.streams.video[0]
        info = _stream_info(stream)
        wanted = window.source_indices(info.frames, info.fps)
        last = wanted[-1]
        decoded: dict[int, Image.Image] = {}
        needed = set(wanted)
        count = 0
        try:
            for count, frame in enumerate(container.decode(stream)):
                if count in needed:
                    decoded[count] = frame.to_image()
                if count >= last:
                    break
        except (av.error.FFmpegError, OSError) as exc:
            raise BadVideo(f"corrupt or truncated video after frame {count} ({exc})") from None
    finally:
        container.close()
    if last not in decoded:
        got = count + 1 if decoded or count else 0
        raise BadVideo(f"truncated: decoded {got} frames, the header promises {info.frames} and {last + 1} are needed")
    return [decoded[index] for index in wanted], info


def resize_and_crop_clip(frames: list[Image.Image], height: int, width: int, resample: str = "bicubic") -> torch.Tensor:
    """float32 [3, T, height, width] in [-1, 1]: every frame scaled to cover height x width, then its centre."""
    return torch.stack([resize_and_crop(frame, height, width, resample) for frame in frames], dim=1)


def load_clip(data: bytes | str | Path, window: FrameWindow, height: int, width: int) -> torch.Tensor:
    """The window of a clip, decoded, resized and centre-cropped: float32 [3, T, height, width] in [-1, 1]."""
    frames, _ = decode_frames(data, window)
    return resize_and_crop_clip(frames, height, width)


def write_clip(path: str | Path, frames: torch.Tensor, fps: float = 16.0, codec: str = "libx264") -> Path:
    """Write uint8 frames [T, H, W, 3] (or float [3, T, H, W] in [-1, 1]) as a video file (mp4 by default).

    H.264 needs even sides; an odd side is padded by repeating the last row or column.
    """
    if frames.dtype != torch.uint8:
        frames = ((frames.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0)
    array = np.ascontiguousarray(frames.numpy())
    pad_h, pad_w = array.shape[1] % 2, array.shape[2] % 2
    if pad_h or pad_w:
        array = np.pad(array, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    path, av = Path(path), pyav()
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = array.shape[2], array.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in array:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
