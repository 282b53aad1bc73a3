"""The training data of a run, from its [data] and [training] config: dataset, loader, held-out set."""

from dataclasses import dataclass
from pathlib import Path

from sana2.config import ConfigError, JobConfig
from sana2.data.digits import build_digits_dataset
from sana2.data.features import FeatureDataset
from sana2.data.loader import DistributedFeatureLoader
from sana2.distributed.utils import RunOnRank0Error, run_on_rank0


@dataclass
class TrainingData:
    dataset: FeatureDataset
    loader: DistributedFeatureLoader
    val_dir: Path | None  # the held-out set for the validation loss, if any


def build_training_data(config: JobConfig, dp_rank: int, dp_world_size: int) -> TrainingData:
    train_dir, val_dir = _data_dirs(config)
    dataset = FeatureDataset(train_dir)
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
        raise ConfigError(f"{config.source}: [training] does not fit data.path {train_dir}: {exc}") from None
    return TrainingData(dataset, loader, val_dir)


def _data_dirs(config: JobConfig) -> tuple[Path, Path | None]:
    data = config.data
    if data.path != "digits":
        return Path(data.path), Path(data.val_path) if data.val_path else None
    # built once beside the dump folder, so runs with other dump folders share it
    root = Path(config.job.dump_folder).parent / "data" / "digits"
    try:  # one builder; the others wait and read the result
        return run_on_rank0(
            lambda: build_digits_dataset(root, data.text_encoder, data.caption_length),
            lambda exc: (
                f"{config.source}: cannot build the digits data with data.text_encoder = {data.text_encoder!r}: {exc}"
            ),
        )
    except RunOnRank0Error as exc:
        raise ConfigError(str(exc)) from None
