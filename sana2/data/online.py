"""Online encoding ([data] mode = "online"): training reads images and captions and encodes them in the step.

The samples are planned exactly as `sana2-prepare` plans them (sana2/data/dataset_plan.py), and every batch goes
through the same functions (`load_pixels`, `encode_batch` of sana2/data/shard_encoding.py). So with the
same inputs and settings, sample i here is sample i of the precomputed dataset, in the same bucket, with
the same caption and the same features (up to the dtype prepare stores them in), and training online
takes the steps training on the precomputed features takes.

An image whose header reads may still fail to decode (a truncated file). Before training, every image is
decoded once (each rank a share, in worker processes), and the failures are left out and reported as
sana2-prepare reports them: in <dump_folder>/skipped.jsonl, with every other skipped input. The outcome
is kept in <dump_folder>/online_check.json under the plan's fingerprint, so a resumed run skips the pass.

An image that goes bad later (overwritten or truncated during the run) is skipped where a batch draws it:
its slot takes the next sample of the same bucket by dataset index (wrapping around; the next again if
that one fails too), so the batch keeps its size and its one bucket, and every rank's text encoder still
makes one call per micro-batch. Whether a sample is skipped is decided by decoding it, so by the file's
content, and its replacement by its index alone: a resubmission (whose start-up reuses the recorded
check) makes the same decisions, at any world size. The slot keeps its sample index for its noise. Each
skip is said on the console with the count so far, and appended to <dump_folder>/skipped.jsonl with
"found": "in training" (kept there when a resubmission writes the report again).

The settings are the [encoding] section, the same description sana2-prepare reads (sana2/config.py's
Encoding). The VAE runs on every rank (its encoder only); the text encoder is sharded over all ranks
(sana2/distributed/frozen_encoder.py) unless encoding.shard_text_encoder is false. A sharded encoder's
forwards are collectives: every rank encodes the same number of batches per step (one per
micro-batch), which the loader guarantees.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from sana2.config import Encoding
from sana2.data.buckets import Bucket, parse_buckets, resample_filter
from sana2.data.dataset_plan import PlannedSample, media_source, plan_dataset
from sana2.data.features import SKIP_REPORT_FILE, DataFormatError, batch_bucket, bucket_entry
from sana2.data.frame_window import BadVideo, FrameWindow
from sana2.data.shard_encoding import (
    build_encoding_text_encoder,
    build_encoding_vae,
    decode_image,
    encode_batch,
    latent_shape,
    load_pixels,
)
from sana2.data.video_decode import decode_frames
from sana2.data.video_sources import Clip, list_encoding_inputs
from sana2.data.writer import TRAINING_SKIP, append_skip_report, training_skips, write_skip_report
from sana2.distributed.parallel_dims import ParallelDims
from sana2.encoders.autoencoder import Autoencoder
from sana2.encoders.text_encoder import TextEncoder
from sana2.log import logger
from sana2.staging import staged

CHECK_FILE = "online_check.json"


class OnlineDataset:
    """Planned samples that are encoded when a batch is drawn; read like a FeatureDataset."""

    def __init__(
        self,
        samples: list[PlannedSample],
        sample_buckets: list[int],
        buckets: list[Bucket],
        vae: Autoencoder | None,
        text_encoder: TextEncoder,
        min_size: int,
        resample: str,
        workers: int,
        window: FrameWindow | None = None,
        posterior_seed: int | None = None,
        report_folder: Path | None = None,
    ):
        if not samples:
            raise ValueError("no usable sample among the inputs")
        self.samples, self.vae, self.text_encoder = samples, vae, text_encoder
        self.min_size, self.resample, self.window = min_size, resample, window
        self.posterior_seed = posterior_seed
        self.caption_length, self.caption_dim = text_encoder.max_length, text_encoder.dim
        self.keys = [planned.sample.key for planned in samples]
        self.captions = [planned.caption for planned in samples]
        # the buckets that hold samples, numbered in table order, as sana2-prepare numbers them
        used = sorted(set(sample_buckets))
        number = {bucket: index for index, bucket in enumerate(used)}
        self.bucket_ids = torch.tensor([number[b] for b in sample_buckets], dtype=torch.int64)
        self._buckets = used = [buckets[b] for b in used]
        self.latent_shapes = [latent_shape(vae, b, None if window is None else window.num_frames) for b in used]
        self.buckets = [
            bucket_entry(b.name, (b.height, b.width), shape, int((self.bucket_ids == i).sum()))
            for i, (b, shape) in enumerate(zip(used, self.latent_shapes))
        ]
        self._threads = ThreadPoolExecutor(max_workers=max(workers, 1))
        # each bucket's sample indices in order: where a sample that no longer decodes finds its replacement
        self._members = [torch.nonzero(self.bucket_ids == b).flatten().tolist() for b in range(len(used))]
        self.report_folder = report_folder
        self.skipped_in_training: dict[str, str] = {}  # sample key -> reason, of this process

    def __len__(self) -> int:
        return len(self.samples)

    def latent_shape_of(self, index: int) -> tuple[int, ...]:
        return self.latent_shapes[int(self.bucket_ids[index])]

    def get_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """As FeatureDataset.get_batch, encoded now. Collective when the text encoder is sharded."""
        bucket_index = batch_bucket(self.bucket_ids, indices)
        bucket = self._buckets[bucket_index]
        load = lambda i: load_pixels(self.samples[i], bucket, self.min_size, self.resample, self.window)  # noqa: E731
        indices = [int(i) for i in indices]
        loaded = list(self._threads.map(load, indices))
        for slot, (_, reason) in enumerate(loaded):
            if reason is not None:  # went bad since the start-up check: the next of its bucket that decodes
                indices[slot], loaded[slot] = self._replacement(indices[slot], reason, bucket_index, load)
        planned = [self.samples[i] for i in indices]
        pixels = [pixels for pixels, _ in loaded]
        encoded = encode_batch(planned, pixels, self.vae, self.text_encoder, self.posterior_seed)
        return {
            "latents": encoded.latents.float(),
            "caption_embeds": encoded.caption_embeds.float().unsqueeze(1),
            "caption_mask": encoded.caption_mask.float(),
        }

    def _replacement(self, index: int, reason: str, bucket_index: int, load) -> tuple[int, tuple]:
        """(the index, the loaded pixels) of the next sample after `index` in its bucket that decodes; each
        failure on the way is reported. DataFormatError when no sample of the bucket decodes any more."""
        members = self._members[bucket_index]
        at = members.index(index)
        for step in range(1, len(members) + 1):
            self._report(index, reason)
            index = members[(at + step) % len(members)]
            pixels, reason = load(index)
            if reason is None:
                return index, (pixels, None)
        raise DataFormatError(
            f"no sample of bucket {self._buckets[bucket_index].name} decodes any more (the last: "
            f"{self.samples[index].sample.image.describe()}: {reason}); see {self._report_path()}"
        )

    def _report(self, index: int, reason: str) -> None:
        """Say a sample skipped in training, once per process: on the console and in the skip report."""
        planned = self.samples[index]
        if self.skipped_in_training.get(planned.sample.key) == reason:
            return
        self.skipped_in_training[planned.sample.key] = reason
        source = planned.sample.image.describe()
        if self.report_folder is not None:
            append_skip_report(self.report_folder, {"source": source, "reason": reason, "found": TRAINING_SKIP})
        logger.warning(
            f"{source}: {reason}; it decoded when training started: skipped, its slot takes the next sample of "
            f"its bucket; {len(self.skipped_in_training)} inputs skipped in training so far, listed in "
            f"{self._report_path()}"
        )

    def _report_path(self) -> Path | str:
        return self.report_folder / SKIP_REPORT_FILE if self.report_folder is not None else "no report (no folder)"

    def null_caption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty prompt through the text encoder (collective when it is sharded)."""
        return self.text_encoder.null_caption()


def build_online_dataset(
    inputs: list[str],
    encoding: Encoding,
    caption_length: int,
    dims: ParallelDims,
    device: torch.device,
    dump_folder: Path,
    text_encoder: TextEncoder | None = None,
) -> OnlineDataset:
    """The online dataset of `inputs` encoded as `encoding` says; every rank calls it (collectives inside).
    Each data-parallel rank of `dims` checks its share of the inputs, and a sharded text encoder is split
    over the data mesh. A given `text_encoder` is used instead of building one (joint training's images
    share the clips' encoder)."""
    buckets = parse_buckets(encoding.buckets)
    window = encoding.window()
    listing = list_encoding_inputs(inputs, encoding)
    settings = {"inputs": [str(Path(p).resolve()) for p in inputs], **encoding.settings()}
    # one shard per bucket: the samples in the order sana2-prepare's shards hold them, whatever its shard size
    plan = plan_dataset(
        listing,
        buckets,
        encoding.caption_proportion,
        encoding.seed,
        encoding.min_size,
        max(len(listing.samples), 1),
        settings,
        window,
    )
    planned = [(sample, shard.bucket) for shard in plan.shards for sample in shard.samples]
    failures = _decode_failures(planned, plan.fingerprint, encoding, window, dims, dump_folder)
    usable = [(sample, bucket) for sample, bucket in planned if sample.sample.key not in failures]
    if dims.rank == 0:
        skipped = [{"source": s.source, "reason": s.reason} for s in plan.skipped]
        skipped += [
            {"source": s.sample.image.describe(), "reason": failures[s.sample.key]}
            for s, _ in planned
            if s.sample.key in failures
        ]
        write_skip_report(dump_folder, skipped + training_skips(dump_folder))
    if not usable:
        raise ValueError(f"data.inputs {inputs}: no usable sample; see {dump_folder / SKIP_REPORT_FILE}")
    vae = build_encoding_vae(encoding, device)
    if text_encoder is None:
        text_encoder = build_encoding_text_encoder(encoding, caption_length, device, dims)
    return OnlineDataset(
        [sample for sample, _ in usable],
        [bucket for _, bucket in usable],
        buckets,
        vae,
        text_encoder,
        encoding.min_size,
        resample_filter(encoding.buckets),
        encoding.workers,
        window,
        encoding.seed if encoding.posterior == "sample" else None,
        dump_folder,
    )


class _DecodeCheck(Dataset):
    def __init__(self, samples: list[PlannedSample], min_size: int, window: FrameWindow | None):
        self.samples, self.min_size, self.window = samples, min_size, window

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> str | None:
        planned = self.samples[index]
        if isinstance(planned.sample, Clip):  # every frame of its window decodes
            try:
                decode_frames(media_source(planned.sample.image), self.window)
            except OSError as exc:
                return f"unreadable file ({exc})"
            except BadVideo as exc:
                return str(exc)
            return None
        return decode_image(planned, self.min_size)[1]


def _decode_failures(
    planned, fingerprint: str, encoding, window: FrameWindow | None, dims: ParallelDims, dump_folder: Path
) -> dict[str, str]:
    """{sample key: reason} of the planned images that do not decode: from an earlier run's check of the same
    plan, else decoded now, each data rank every dp_size-th image (the ranks of one cp group decode the same
    ones) and gathered over the data mesh."""
    check_file = dump_folder / CHECK_FILE
    rank, world_size = dims.data_rank, dims.dp_size
    recorded = [json.loads(check_file.read_text()) if dims.rank == 0 and check_file.is_file() else None]
    if dims.world_size > 1:  # global rank 0's view over every rank, cp groups included: all take the same branch
        dist.broadcast_object_list(recorded, src=0)
    if recorded[0] is not None and recorded[0].get("fingerprint") == fingerprint:
        return recorded[0]["failures"]
    mine = [sample for sample, _ in planned[rank::world_size]]
    loader = DataLoader(_DecodeCheck(mine, encoding.min_size, window), batch_size=None, num_workers=encoding.workers)
    failures = {sample.sample.key: reason for sample, reason in zip(mine, loader) if reason is not None}
    if world_size > 1:  # one part per data rank: the default group would hold cp copies of each
        gathered = [None] * world_size
        dist.all_gather_object(gathered, failures, group=dims.data_mesh.get_group())
        failures = {key: reason for part in gathered for key, reason in part.items()}
    if dims.rank == 0:
        dump_folder.mkdir(parents=True, exist_ok=True)
        with staged(check_file, replace=True) as temporary:
            temporary.write_text(json.dumps({"fingerprint": fingerprint, "failures": failures}, indent=1))
    return failures
