"""The training data of a run, from its [data], [encoding] and [training] config: dataset, loader, held-out
set, null caption."""

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sana2.config import BatchSizes, Data, Encoding, Training
from sana2.data.digits import build_digits_dataset
from sana2.data.features import FeatureDataset
from sana2.data.joint import JointLoader
from sana2.data.loader import DistributedFeatureLoader
from sana2.data.online import OnlineDataset, build_online_dataset
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.utils import RunOnRank0Error, run_on_rank0
from sana2.encoders.text_encoder import TextEncoder


@dataclass
class TrainingData:
    dataset: FeatureDataset | OnlineDataset
    loader: DistributedFeatureLoader | JointLoader
    val_dir: Path | None  # the held-out set for the validation loss, if any
    # the empty prompt's embedding [L, C_cap] for the model's null caption, where the data has one
    null_caption: torch.Tensor | None
    text_encoder: TextEncoder | None = None  # online: the (sharded) encoder, for the validation prompts too
    image_dataset: FeatureDataset | OnlineDataset | None = None  # joint training: the images

    @property
    def datasets(self) -> list:
        """Every dataset the run trains on (the model must fit each one's buckets)."""
        return [self.dataset] + ([self.image_dataset] if self.image_dataset is not None else [])


class TrainingDataError(ValueError):
    """Data the run cannot train on, named by its config key (the caller adds the config file)."""


def build_training_data(
    data: Data,
    encoding: Encoding,
    training: Training,
    dump_folder: Path,
    dims: ParallelDims,
    batch: BatchSizes,
    device: torch.device,
    *,
    caption_length: int,
) -> TrainingData:
    """Every rank calls it: in online mode it builds the (sharded) encoders, and encodes the null caption;
    captions are encoded to `caption_length` tokens (the model's model_max_length).
    The data is split over the data-parallel ranks of `dims`, `batch` samples per rank and micro-batch.
    `dump_folder` is the run's: online mode writes its skip reports there, the digits data beside it."""
    dp_rank, dp_world_size = dims.data_rank, dims.dp_size
    if data.mode == "online":
        dataset = _online_dataset(data, encoding, caption_length, dump_folder, dims, device)
        train_dir, val_dir = None, Path(data.val_path) if data.val_path else None
    else:
        train_dir, val_dir = _data_dirs(data, encoding, caption_length, dump_folder)
        dataset = FeatureDataset(train_dir)
    null = dataset.null_caption()
    accumulation = training.gradient_accumulation_steps
    where = f"data.path {train_dir}" if train_dir else f"data.inputs {data.inputs}"
    loader = _loader(dataset, batch.local, accumulation, dp_rank, dp_world_size, training.seed, where)
    text_encoder = dataset.text_encoder if isinstance(dataset, OnlineDataset) else None
    image_dataset = None
    if training.joint_training_interval:
        image_dataset, where = _image_dataset(data, encoding, caption_length, dump_folder, dims, device, text_encoder)
        # the images' order has its own seed stream: adding images does not change the video order
        seed = training.seed + 1
        images = _loader(image_dataset, batch.image_local, accumulation, dp_rank, dp_world_size, seed, where)
        loader = JointLoader(loader, images, training.joint_training_interval)
    null = None if null is None else null[0]
    return TrainingData(dataset, loader, val_dir, null, text_encoder, image_dataset)


def _loader(dataset, local_batch_size, accumulation, dp_rank, dp_world_size, seed, where) -> DistributedFeatureLoader:
    try:
        return DistributedFeatureLoader(dataset, local_batch_size, accumulation, dp_rank, dp_world_size, seed)
    except ValueError as exc:  # e.g. fewer samples than one global batch
        raise TrainingDataError(f"[training] does not fit {where}: {exc}") from None


def _image_dataset(
    data: Data, encoding: Encoding, caption_length: int, dump_folder: Path, dims: ParallelDims, device, text_encoder
):
    """The images of joint training, and where they come from (for messages)."""
    if data.mode != "online":
        return FeatureDataset(data.image_path), f"data.image_path {data.image_path}"
    encoding = replace(encoding, buckets=data.image_buckets or encoding.buckets, num_frames=0)
    dump = Path(dump_folder) / "image_data"  # its own skip report and decode check
    try:
        dataset = build_online_dataset(
            data.image_inputs, encoding, caption_length, dims, device, dump, text_encoder=text_encoder
        )
    except (ValueError, FileNotFoundError) as exc:
        raise TrainingDataError(f"[data] online images: {exc}") from None
    return dataset, f"data.image_inputs {data.image_inputs}"


def _online_dataset(
    data: Data, encoding: Encoding, caption_length: int, dump_folder: Path, dims: ParallelDims, device
) -> OnlineDataset:
    try:
        return build_online_dataset(data.inputs, encoding, caption_length, dims, device, Path(dump_folder))
    except (ValueError, FileNotFoundError) as exc:  # inputs, encoder folders, bucket sizes the VAE cannot take
        raise TrainingDataError(f"[data] online, [encoding]: {exc}") from None


def _data_dirs(data: Data, encoding: Encoding, caption_length: int, dump_folder: Path) -> tuple[Path, Path | None]:
    if data.path != "digits":
        return Path(data.path), Path(data.val_path) if data.val_path else None
    # built once beside the dump folder, so runs with other dump folders share it
    root = Path(dump_folder).parent / "data" / "digits"
    try:  # one builder; the others wait and read the result
        return run_on_rank0(
            lambda: build_digits_dataset(root, encoding.text_encoder, caption_length),
            lambda exc: (
                f"cannot build the digits data in {root} with encoding.text_encoder = {encoding.text_encoder!r}: {exc}"
            ),
        )
    except RunOnRank0Error as exc:
        raise TrainingDataError(str(exc)) from None
