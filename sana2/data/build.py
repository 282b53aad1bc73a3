"""The training data of a run, from its [data] and [training] config: dataset, loader, held-out set, null caption."""

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from sana2.config import BatchSizes, JobConfig
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


def build_training_data(config: JobConfig, dims: ParallelDims, batch: BatchSizes, device: torch.device) -> TrainingData:
    """Every rank calls it: in online mode it builds the (sharded) encoders, and encodes the null caption.
    The data is split over the data-parallel ranks of `dims`, `batch` samples per rank and micro-batch."""
    dp_rank, dp_world_size = dims.data_rank, dims.dp_size
    if config.data.mode == "online":
        dataset = _online_dataset(config, dims, device)
        train_dir, val_dir = None, Path(config.data.val_path) if config.data.val_path else None
    else:
        train_dir, val_dir = _data_dirs(config)
        dataset = FeatureDataset(train_dir)
    null = dataset.null_caption()
    training = config.training
    where = f"data.path {train_dir}" if train_dir else f"data.inputs {config.data.inputs}"
    loader = _loader(config, dataset, batch.local, dp_rank, dp_world_size, training.seed, where)
    text_encoder = dataset.text_encoder if isinstance(dataset, OnlineDataset) else None
    image_dataset = None
    if training.joint_training_interval:
        image_dataset, where = _image_dataset(config, dims, device, text_encoder)
        # the images' order has its own seed stream: adding images does not change the video order
        seed = training.seed + 1
        images = _loader(config, image_dataset, batch.image_local, dp_rank, dp_world_size, seed, where)
        loader = JointLoader(loader, images, training.joint_training_interval)
    null = None if null is None else null[0]
    return TrainingData(dataset, loader, val_dir, null, text_encoder, image_dataset)


def _loader(config, dataset, local_batch_size, dp_rank, dp_world_size, seed, where) -> DistributedFeatureLoader:
    accumulation = config.training.gradient_accumulation_steps
    try:
        return DistributedFeatureLoader(dataset, local_batch_size, accumulation, dp_rank, dp_world_size, seed)
    except ValueError as exc:  # e.g. fewer samples than one global batch
        raise config.error(f"[training] does not fit {where}: {exc}") from None


def _image_dataset(config: JobConfig, dims: ParallelDims, device, text_encoder) -> tuple:
    """The images of joint training, and where they come from (for messages)."""
    data = config.data
    if data.mode != "online":
        return FeatureDataset(data.image_path), f"data.image_path {data.image_path}"
    encoding = replace(config.encoding, buckets=data.image_buckets or config.encoding.buckets, num_frames=0)
    dump = Path(config.job.dump_folder) / "image_data"  # its own skip report and decode check
    try:
        dataset = build_online_dataset(
            data.image_inputs, encoding, data.caption_length, dims, device, dump, text_encoder=text_encoder
        )
    except (ValueError, FileNotFoundError) as exc:
        raise config.error(f"[data] online images: {exc}") from None
    return dataset, f"data.image_inputs {data.image_inputs}"


def _online_dataset(config: JobConfig, dims: ParallelDims, device: torch.device) -> OnlineDataset:
    try:
        data = config.data
        dump_folder = Path(config.job.dump_folder)
        return build_online_dataset(data.inputs, config.encoding, data.caption_length, dims, device, dump_folder)
    except (ValueError, FileNotFoundError) as exc:  # inputs, encoder folders, bucket sizes the VAE cannot take
        raise config.error(f"[data] online, [encoding]: {exc}") from None


def _data_dirs(config: JobConfig) -> tuple[Path, Path | None]:
    data, encoding = config.data, config.encoding
    if data.path != "digits":
        return Path(data.path), Path(data.val_path) if data.val_path else None
    # built once beside the dump folder, so runs with other dump folders share it
    root = Path(config.job.dump_folder).parent / "data" / "digits"
    try:  # one builder; the others wait and read the result
        return run_on_rank0(
            lambda: build_digits_dataset(root, encoding.text_encoder, data.caption_length),
            lambda exc: (
                f"cannot build the digits data in {root} with encoding.text_encoder = {encoding.text_encoder!r}: {exc}"
            ),
        )
    except RunOnRank0Error as exc:
        raise config.error(str(exc)) from None
