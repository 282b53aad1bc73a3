"""Images as Sana feeds them to its VAE: decoded to RGB, resized to cover a bucket, centre-cropped, in [-1, 1].

Sana's multi-scale dataset scales the image by the larger of (bucket height / image height, bucket width /
image width), so that the bucket fits inside the scaled image, resizes with bicubic interpolation (Lanczos
for its 2048-and-larger tables), crops the centre (the top-left corner rounded as torchvision's
CenterCrop rounds it), and maps 0..255 to -1..1. Decoding failures (unreadable, truncated or oversized
files) raise BadImage with the reason, for the caller to skip and report the file.
"""

import io

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}


class BadImage(ValueError):
    """An image that cannot be used; the message says why."""


def _open(data: bytes) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise BadImage("not an image file PIL can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadImage(f"unreadable image ({exc})") from None


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the image header, without decoding the pixels."""
    with _open(data) as image:
        return image.size


def decode_rgb(data: bytes) -> Image.Image:
    """The whole image, decoded and converted to RGB; a truncated or corrupt file raises BadImage."""
    image = _open(data)
    try:
        image.load()  # decodes every pixel: a truncated file fails here, not later
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise BadImage(f"corrupt or truncated image ({exc})") from None
    finally:
        image.close()


def resize_and_crop(image: Image.Image, height: int, width: int, resample: str = "bicubic") -> torch.Tensor:
    """float32 [3, height, width] in [-1, 1]: `image` scaled to cover height x width, then its centre."""
    src_width, src_height = image.size
    if height / src_height > width / src_width:
        new_height, new_width = height, int(src_width * height / src_height)
    else:
        new_height, new_width = int(src_height * width / src_width), width
    # float rounding can land one pixel short of the bucket; never crop outside the image
    new_height, new_width = max(new_height, height), max(new_width, width)
    resized = image.resize((new_width, new_height), RESAMPLE[resample])
    top = int(round((new_height - height) / 2.0))
    left = int(round((new_width - width) / 2.0))
    cropped = resized.crop((left, top, left + width, top + height))
    pixels = torch.from_numpy(np.asarray(cropped, dtype=np.uint8).copy()).permute(2, 0, 1)
    return pixels.float() / 127.5 - 1.0
