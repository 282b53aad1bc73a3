"""The data manifest (DatasetPlan): what `sana2-prepare` writes and online mode encodes.

Every usable sample in its bucket and shard, and every skip with its reason.

The plan is a pure function of the inputs and the settings, so every rank computes the same one, and a
run resumed after an interruption recognises the shards it already wrote (its fingerprint must match the
one recorded by the interrupted run). Image sizes come from the inputs where they state them, else from
the image headers (the pixels are decoded later, when the sample is encoded); reading the headers is
split over the ranks.
"""

import hashlib
import json
from dataclasses import asdict, dataclass

import torch.distributed as dist

from sana2.data.buckets import Bucket, nearest_bucket
from sana2.data.frame_window import BadVideo, FrameWindow
from sana2.data.image import BadImage, image_size
from sana2.data.sources import Listing, Sample, Skip, choose_caption
from sana2.data.video_decode import probe
from sana2.data.video_sources import Clip


@dataclass(frozen=True)
class PlannedSample:
    sample: Sample
    caption: str
    caption_type: str


@dataclass(frozen=True)
class PlannedShard:
    index: int
    bucket: int
    samples: tuple[PlannedSample, ...]


@dataclass
class DatasetPlan:
    buckets: list[Bucket]
    shards: list[PlannedShard]
    skipped: list[Skip]
    fingerprint: str


def plan_dataset(
    listing: Listing,
    buckets: list[Bucket],
    caption_proportion: dict[str, float],
    seed: int,
    min_size: int,
    shard_size: int,
    settings: dict,
    window: FrameWindow | None = None,
) -> DatasetPlan:
    """Assign every sample of `listing` a caption, a bucket and a shard (`settings` enter the fingerprint).

    Clips need the frame `window`: one too short for it is skipped here, from its header's frame count.
    """
    skipped = list(listing.skipped)
    sizes = _image_sizes(listing.samples, window)
    per_bucket: list[list[PlannedSample]] = [[] for _ in buckets]
    for sample, size in zip(listing.samples, sizes):
        if isinstance(size, str):
            skipped.append(Skip(sample.image.describe(), size))
            continue
        width, height = size
        if min(width, height) < min_size:
            skipped.append(
                Skip(sample.image.describe(), f"smaller than the minimum size {min_size} ({width}x{height})")
            )
            continue
        caption = choose_caption(sample, caption_proportion, seed)
        if isinstance(caption, Skip):
            skipped.append(caption)
            continue
        caption_type, text = caption
        per_bucket[nearest_bucket(height, width, buckets)].append(PlannedSample(sample, text, caption_type))
    shards = []
    for bucket, members in enumerate(per_bucket):
        for start in range(0, len(members), shard_size):
            shards.append(PlannedShard(len(shards), bucket, tuple(members[start : start + shard_size])))
    return DatasetPlan(buckets, shards, skipped, _fingerprint(settings, buckets, shards))


def _image_sizes(samples: list[Sample], window: FrameWindow | None) -> list[tuple[int, int] | str]:
    """(width, height) of each sample, or the reason it has none; each rank reads every N-th header."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = {index: _media_size(samples[index], window) for index in range(rank, len(samples), world)}
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = {index: size for part in gathered for index, size in part.items()}
    return [mine[index] for index in range(len(samples))]


def _media_size(sample: Sample, window: FrameWindow | None) -> tuple[int, int] | str:
    return _clip_size(sample, window) if isinstance(sample, Clip) else _image_size(sample)


def _clip_size(clip: Clip, window: FrameWindow | None) -> tuple[int, int] | str:
    """(width, height) of a clip long enough for `window` (stated by the input, else from its header)."""
    if window is None:
        raise ValueError(f"{clip.image.describe()}: a clip needs the frame window (num_frames, fps)")
    size, frames, fps = clip.size, clip.frames, clip.fps
    if size is None or frames is None or fps is None:
        try:
            info = probe(media_source(clip.image))
        except OSError as exc:
            return f"unreadable file ({exc})"
        except BadVideo as exc:
            return str(exc)
        size = size or (info.width, info.height)
        frames, fps = frames or info.frames, fps or info.fps
    try:
        window.source_indices(frames, fps)
    except BadVideo as exc:
        return str(exc)
    return size


def media_source(location) -> str | bytes:
    """A whole file by its path (decoders read what they need), anything else (a member) by its bytes."""
    whole_file = getattr(location, "offset", None) == 0 and getattr(location, "length", None) == -1
    return location.path if whole_file else location.read()


def _image_size(sample: Sample) -> tuple[int, int] | str:
    if sample.size is not None:
        return sample.size
    try:
        return image_size(sample.image.read())
    except OSError as exc:
        return f"unreadable file ({exc})"
    except BadImage as exc:
        return str(exc)


def _fingerprint(settings: dict, buckets: list[Bucket], shards: list[PlannedShard]) -> str:
    content = {
        "settings": settings,
        "buckets": [asdict(b) for b in buckets],
        "shards": [[s.bucket, [(p.sample.key, p.caption) for p in s.samples]] for s in shards],
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
