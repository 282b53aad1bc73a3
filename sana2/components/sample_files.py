"""Sampled images and clips as files: one per sample, named after its prompt, or one grid on request.

Validation (<dump_folder>/samples/step-<N>/) and `sana2-sample` write through these, so a prompt's
images get the same names and pixels in both. Images are shown as `for_display` makes them (what
TensorBoard shows); a video model's clips, decoded, are written as .mp4.
"""

import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, PngImagePlugin

from sana2.components.sampling import make_grid
from sana2.data.video_decode import write_clip
from sana2.staging import staged

GRID_PADDING = 2  # pixels of white between a grid's cells (none around it)
SLUG_LENGTH = 60  # characters of the prompt kept in a file name


def displayable(images: torch.Tensor) -> torch.Tensor:
    """[N, 1 or 3, H, W] for TensorBoard: the first frame of a video, the first channel of latents
    that no VAE decodes (a rough but honest view of what the model produces)."""
    if images.dim() == 5:
        images = images[:, :, 0]
    if images.shape[1] not in (1, 3):
        images = images[:, :1]
    return images


def for_display(images: torch.Tensor, min_size: int = 64) -> torch.Tensor:
    """Sampled images as shown (TensorBoard's grid, the PNG files): `displayable`, in [-1, 1], on the
    CPU, and enlarged by whole pixels when narrower than `min_size` (8x8 digits are legible at 64)."""
    shown = displayable(images.float().clamp(-1, 1).cpu())
    if shown.shape[-1] < min_size:
        shown = F.interpolate(shown, scale_factor=min_size // shown.shape[-1], mode="nearest")
    return shown


def sample_names(prompts: list[str], per_prompt: int, suffix: str) -> list[str]:
    """One file name per sample, in sampling order (each prompt's `per_prompt` samples in turn):
    `<prompt number>-<prompt slug>[-<sample number>]<suffix>`, e.g. `0-the_number_7-1.png`.

    The numbers make every name unique (prompts that read alike, or the same prompt twice, stay apart)
    and sort the files in prompt order; the same prompts give the same names.
    """
    width = len(str(len(prompts) - 1))
    names = []
    for number, prompt in enumerate(prompts):
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", prompt).strip("._-")[:SLUG_LENGTH].rstrip("._-") or "prompt"
        stem = f"{number:0{width}d}-{slug}"
        names += [f"{stem}-{image}{suffix}" if per_prompt > 1 else f"{stem}{suffix}" for image in range(per_prompt)]
    return names


def image_grid(images: torch.Tensor, per_row: int) -> torch.Tensor:
    """[C, H', W']: images [N, C, H, W] in [-1, 1] tiled `per_row` to a row with white between them (a single
    image is itself, without a frame)."""
    grid = make_grid(images, nrow=per_row, padding=GRID_PADDING, pad_value=1.0)
    return grid[:, GRID_PADDING:-GRID_PADDING, GRID_PADDING:-GRID_PADDING]


def clips_for_display(videos: torch.Tensor) -> torch.Tensor:
    """[N, 3, T, H', W']: each frame of the clips [N, C, T, H, W] as `for_display` shows an image, in RGB."""
    clips = torch.stack([for_display(videos[:, :, t]) for t in range(videos.shape[2])], dim=2)
    return clips.expand(-1, 3, *clips.shape[2:]) if clips.shape[1] == 1 else clips


def video_grid(videos: torch.Tensor, per_row: int) -> torch.Tensor:
    """[3, T, H', W']: the clips [N, C, T, H, W] tiled frame by frame as `image_grid` tiles images."""
    clips = clips_for_display(videos)
    return torch.stack([image_grid(clips[:, :, t], per_row) for t in range(clips.shape[2])], dim=1)


def write_png(image: torch.Tensor, path: Path, tag: str = "") -> tuple[int, int]:
    """An image [1 or 3, H, W] in [-1, 1] as a PNG, published complete or not at all (an earlier file of that
    name is replaced); `tag` goes into its "Software" text chunk. Returns its (width, height)."""
    pixels = ((image.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
    picture = Image.fromarray(np.ascontiguousarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels))
    info = PngImagePlugin.PngInfo()
    if tag:
        info.add_text("Software", tag)
    with staged(path, replace=True) as temporary:
        picture.save(temporary, format="PNG", pnginfo=info)
    return picture.size


def write_samples(
    samples: torch.Tensor, prompts: list[str], per_prompt: int, folder: Path, fps: float, tag: str = ""
) -> list[Path]:
    """Each sample of `samples` (images [N, C, H, W], or decoded clips [N, 3, T, H, W] in [-1, 1]) as its own
    file in `folder`, named by `sample_names`: a PNG of the image as shown, or an .mp4 at `fps`."""
    video = samples.dim() == 5
    names = sample_names(prompts, per_prompt, ".mp4" if video else ".png")
    folder.mkdir(parents=True, exist_ok=True)
    if video:
        return [write_clip(folder / name, clip, fps, tag=tag) for name, clip in zip(names, clips_for_display(samples))]
    shown = for_display(samples)
    for name, image in zip(names, shown):
        write_png(image, folder / name, tag)
    return [folder / name for name in names]
