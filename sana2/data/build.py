"""The training data of a run, from its [data] and [training] config: dataset, loader, held-out set, null caption."""

from dataclasses import dataclass
from pathlib import Path

import torch

from sana2.config import JobConfig
from sana2.data.digits import build_digits_dataset
from sana2.data.features import FeatureDataset
from sana2.data.loader import DistributedFeatureLoader
from sana2.data.online import OnlineDataset, build_online_dataset
from sana2.distributed.utils import RunOnRank0Error, run_on_rank0
from sana2.encoders.text_encoder import TextEncoder


@dataclass
class TrainingData:
    dataset: FeatureDataset | OnlineDataset
    loader: DistributedFeatureLoader
    val_dir: Path | None  # the held-out set for the validation loss, if any
    # the empty prompt's embedding [L, C_cap] for the model's null caption, where the data has one
    null_caption: torch.Tensor | None
    text_encoder: TextEncoder | None = None  # online: the (sharded) encoder, for the validation prompts too


def build_training_data(config: JobConfig, dp_rank: int, dp_world_size: int, device: torch.device) -> TrainingData:
    """Every rank calls it: in online mode it builds the (sharded) encoders, and encodes the null caption."""
    if config.data.mode == "online":
        dataset = _online_dataset(config, dp_rank, dp_world_size, device)
        train_dir, val_dir = None, Path(config.data.val_path) if config.data.val_path else None
    else:
        train_dir, val_dir = _data_dirs(config)
        dataset = FeatureDataset(train_dir)
    null = dataset.null_caption()
    training = config.training
    try:
        loader = DistributedFeatureLoader(
            dataset,
            training.local_batch_size,
            training.gradient_accumulation_steps,
            dp_rank,
            dp_world_size,
            training.seed,
        )
    except ValueError as exc:  # e.g. fewer samples than one global batch
        where = f"data.path {train_dir}" if train_dir else f"data.inputs {config.data.inputs}"
        raise config.error(f"[training] does not fit {where}: {exc}") from None
    text_encoder = dataset.text_encoder if isinstance(dataset, OnlineDataset) else None
    return TrainingData(dataset, loader, val_dir, None if null is None else null[0], text_encoder)


def _online_dataset(config: JobConfig, rank: int, world_size: int, device: torch.device) -> OnlineDataset:
    try:
        return build_online_dataset(config.data, rank, world_size, device, Path(config.job.dump_folder))
    except (ValueError, FileNotFoundError) as exc:  # inputs, encoder folders, bucket sizes the VAE cannot take
        raise config.error(f"[data] online: {exc}") from None


def _data_dirs(config: JobConfig) -> tuple[Path, Path | None]:
    data = config.data
    if data.path != "digits":
        return Path(data.path), Path(data.val_path) if data.val_path else None
    # built once beside the dump folder, so runs with other dump folders share it
    root = Path(config.job.dump_folder).parent / "data" / "digits"
    try:  # one builder; the others wait and read the result
        return run_on_rank0(
            lambda: build_digits_dataset(root, data.text_encoder, data.caption_length),
            lambda exc: f"cannot build the digits data in {root} with data.text_encoder = {data.text_encoder!r}: {exc}",
        )
    except RunOnRank0Error as exc:
        raise config.error(str(exc)) from None
