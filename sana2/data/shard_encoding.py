"""Encoding planned shards: images decoded and cropped to their bucket (in DataLoader workers), captions and images
through the encoders, each shard written when its last sample is in.

Batches never cross a shard (a shard is one bucket, one image size). Each batch makes exactly one text-encoder
call, whatever its images turn out to be: a sharded text encoder's forwards are collectives that all ranks must
make together, so the start of a batch is the one point where every rank is in step, and the stop agreement
(`stop_here`, sana2/prepare.py) is taken there. An image that fails to decode is left out of its shard and
recorded in the shard's metadata with the reason.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from sana2.cli import torch_dtype
from sana2.data.buckets import Bucket
from sana2.data.dataset_plan import DatasetPlan, PlannedSample, PlannedShard, media_source
from sana2.data.features import shard_file_name
from sana2.data.frame_window import BadVideo, FrameWindow
from sana2.data.image import BadImage, decode_rgb, resize_and_crop
from sana2.data.video_decode import load_clip
from sana2.data.video_sources import Clip
from sana2.data.writer import write_shard
from sana2.distributed.parallel_dims import ParallelDims
from sana2.encoders.autoencoder import Autoencoder, build_autoencoder
from sana2.encoders.text_encoder import TextEncoder, build_text_encoder, resolve_instruction
from sana2.seeding import seeded_generator


def build_encoding_vae(encoding, device: torch.device) -> Autoencoder | None:
    """The VAE of an [encoding] section (sana2/config.py's Encoding), its encoder only; None for "none"."""
    if encoding.vae == "none":
        return None
    dtype = torch_dtype(encoding.dtype)
    return build_autoencoder(encoding.vae, device=device, dtype=dtype, keep_decoder=False, tiling=encoding.vae_tiling)


def build_encoding_text_encoder(encoding, caption_length: int, device: torch.device, dims: ParallelDims) -> TextEncoder:
    """The text encoder of an [encoding] section, sharded over the data mesh of `dims` where it says so."""
    shard = encoding.shard_text_encoder and dims.dp_size > 1
    return build_text_encoder(
        encoding.text_encoder,
        caption_length,
        device=device,
        dtype=torch_dtype(encoding.dtype),
        instruction=resolve_instruction(encoding.text_encoder, encoding.instruction),
        mesh=dims.data_mesh if shard else None,
    )


def latent_shape(vae: Autoencoder | None, bucket: Bucket, frames: int | None = None) -> tuple[int, ...]:
    """One sample's latent shape in `bucket` (clips: of `frames` frames): the VAE's, which checks the size suits
    it, or the pixels' [3, H, W] / [3, T, H, W]."""
    if vae is None:
        return (3, bucket.height, bucket.width) if frames is None else (3, frames, bucket.height, bucket.width)
    return vae.latent_shape(bucket.height, bucket.width, frames)


class ShardImages(Dataset):
    """The images of some shards. Item: (shard index, position in shard, pixels [3, H, W] in [-1, 1] or None,
    skip reason or None)."""

    def __init__(
        self,
        plan: DatasetPlan,
        shards: list[PlannedShard],
        min_size: int,
        resample: str,
        window: FrameWindow | None = None,
    ):
        self.plan, self.min_size, self.resample, self.window = plan, min_size, resample, window
        self.items = [(shard.index, position) for shard in shards for position in range(len(shard.samples))]

    def __len__(self) -> int:
        return len(self.items)

    def batches(self, batch_size: int) -> list[list[int]]:
        """Consecutive items of one shard, at most batch_size of them."""
        batches = []
        for start in range(len(self.items)):
            if self.items[start][1] % batch_size == 0:  # a shard's first item, or a full batch before
                batches.append([])
            batches[-1].append(start)
        return batches

    def __getitem__(self, index: int):
        shard_index, position = self.items[index]
        shard = self.plan.shards[shard_index]
        bucket = self.plan.buckets[shard.bucket]
        pixels = load_pixels(shard.samples[position], bucket, self.min_size, self.resample, self.window)
        return shard_index, position, *pixels


def load_pixels(
    planned: PlannedSample, bucket: Bucket, min_size: int, resample: str, window: FrameWindow | None = None
) -> tuple[torch.Tensor | None, str | None]:
    """(pixels [3, H, W] in [-1, 1] cropped to `bucket`, None), or (None, the reason the image is unusable).

    A clip gives the frames of `window`, [3, T, H, W].
    """
    if isinstance(planned.sample, Clip):
        try:
            return load_clip(media_source(planned.sample.image), window, bucket.height, bucket.width), None
        except OSError as exc:
            return None, f"unreadable file ({exc})"
        except BadVideo as exc:
            return None, str(exc)
    image, reason = decode_image(planned, min_size)
    if image is None:
        return None, reason
    return resize_and_crop(image, bucket.height, bucket.width, resample), None


def decode_image(planned: PlannedSample, min_size: int) -> tuple[Image.Image | None, str | None]:
    """(the decoded RGB image, None), or (None, the reason it is unusable)."""
    try:
        image = decode_rgb(planned.sample.image.read())
    except OSError as exc:
        return None, f"unreadable file ({exc})"
    except BadImage as exc:
        return None, str(exc)
    if min(image.size) < min_size:
        width, height = image.size
        return None, f"smaller than the minimum size {min_size} ({width}x{height})"
    return image, None


@dataclass
class EncodedBatch:
    rows: list[int]  # the batch positions whose image could be used
    latents: torch.Tensor | None  # [len(rows), ...] float32, None when no image could be used
    caption_embeds: torch.Tensor  # [batch, L, C_cap] float32: every caption (one encoder call per batch)
    caption_mask: torch.Tensor  # [batch, L] int64


def encode_batch(
    planned: list[PlannedSample],
    pixels: list[torch.Tensor | None],
    vae: Autoencoder | None,
    text_encoder: TextEncoder,
    posterior_seed: int | None = None,
) -> EncodedBatch:
    """Encode one batch of one bucket: every caption, and the images that could be loaded. Without a VAE the
    pixels are the latents; with `posterior_seed` a KL VAE's latent is drawn with a generator per sample."""
    embeds, mask = text_encoder.encode([p.caption for p in planned])
    rows = [row for row, image in enumerate(pixels) if image is not None]
    latents = None
    if rows:
        images = torch.stack([pixels[row] for row in rows])
        generators = None
        if posterior_seed is not None:
            generators = [seeded_generator("posterior", posterior_seed, planned[row].sample.key) for row in rows]
        latents = images if vae is None else vae.encode(images, generators)
    return EncodedBatch(rows, latents, embeds, mask)


def encode_shards(
    plan: DatasetPlan,
    shards: list[PlannedShard],
    vae: Autoencoder | None,
    text_encoder: TextEncoder,
    output: Path,
    *,
    batch_size: int,
    workers: int,
    min_size: int,
    resample: str,
    dtype: torch.dtype,
    posterior_seed: int | None = None,
    window: FrameWindow | None = None,
    on_shard_written=None,
    show_progress: bool = True,
    stop_here=None,
) -> bool:
    """Encode `shards` (batches as `encode_batch`) and write each one to `output` in `dtype`; True once all are.

    `stop_here()`, called before each batch (on every rank at once), True: stop now and return False. Only
    finished shards are on disk: the one in progress is left for the rerun.
    """
    images = ShardImages(plan, shards, min_size, resample, window)
    loader = DataLoader(images, batch_sampler=images.batches(batch_size), num_workers=workers, collate_fn=list)
    progress = tqdm(total=len(images), unit="img", disable=None if show_progress else True)
    building: _ShardRows | None = None
    for batch in loader:
        if stop_here is not None and stop_here():
            progress.close()
            return False
        shard = plan.shards[batch[0][0]]
        building = building if building is not None and building.shard is shard else _ShardRows(shard)
        planned = [shard.samples[position] for _, position, _, _ in batch]
        encoded = encode_batch(planned, [item[2] for item in batch], vae, text_encoder, posterior_seed)
        # kept in the feature dtype at once: a shard's rows wait in memory until the shard is complete
        building.add(planned, [item[3] for item in batch], encoded, dtype)
        progress.update(len(batch))
        if building.complete:
            building.write(output / shard_file_name(shard.index), plan.buckets[shard.bucket].name)
            if on_shard_written is not None:
                on_shard_written(shard.index)
    progress.close()
    return True


class _ShardRows:
    """The encoded rows of one shard, gathered batch by batch, and the samples left out with their reasons."""

    def __init__(self, shard: PlannedShard):
        self.shard = shard
        self.seen = 0
        self.latents, self.embeds, self.masks, self.keys, self.captions, self.skipped = [], [], [], [], [], []

    def add(self, planned: list[PlannedSample], reasons: list[str | None], encoded: EncodedBatch, dtype) -> None:
        self.seen += len(planned)
        self.skipped += [[p.sample.image.describe(), r] for p, r in zip(planned, reasons) if r is not None]
        if encoded.rows:
            self.latents.append(encoded.latents.to(dtype))
            self.embeds.append(encoded.caption_embeds[encoded.rows].to(dtype))
            self.masks.append(encoded.caption_mask[encoded.rows])
            self.keys += [planned[row].sample.key for row in encoded.rows]
            self.captions += [planned[row].caption for row in encoded.rows]

    @property
    def complete(self) -> bool:
        return self.seen == len(self.shard.samples)

    def write(self, path: Path, bucket_name: str) -> None:
        if self.keys:
            tensors = torch.cat(self.latents), torch.cat(self.embeds), torch.cat(self.masks)
        else:  # every image of the shard failed: an empty shard still records that the shard is done
            tensors = torch.zeros(0), torch.zeros(0, 0, 0), torch.zeros(0, 0, dtype=torch.int64)
        extra = {"sana2_skipped": json.dumps(self.skipped)}
        write_shard(path, *tensors, self.keys, self.captions, bucket_name, extra)
