"""The checks that run before any worker starts: every config key, the world size, the encoders, the checkpoint
to resume.

    python -m sana2.preflight --world-size N CONFIG [--section.key=value ...]

runs them on their own; the launcher (sana2/launch.py) and the trainer run them before they start. A
failed check is one message naming the field and exit code 2.
"""

import importlib.util
import sys
from pathlib import Path

from sana2.cli import USER_ERROR
from sana2.components.model_transforms import build_transforms
from sana2.config import BatchSizes, ConfigError, JobConfig, check_outputs_apart, main_config, resolve_batch
from sana2.distributed.parallel_dims import ParallelDims
from sana2.encoders.autoencoder import folder_latent_channels
from sana2.encoders.text_encoder import check_text_encoder_name
from sana2.formats.step_folder import complete_checkpoints
from sana2.models import model_config


def check_resume_from(config: JobConfig) -> None:
    """checkpoint.resume_from is "latest", "none" or an existing folder (its content is checked when it loads)."""
    target = config.resume_target()
    if isinstance(target, str) or target.exists():
        return
    found = [path.name for _, path in complete_checkpoints(config.checkpoint_folder)]
    there = (
        f"{config.checkpoint_folder} holds {', '.join(found)}" if found else f"{config.checkpoint_folder} holds none"
    )
    raise config.error(
        f"checkpoint.resume_from = {config.checkpoint.resume_from!r}: checkpoint folder {target} does not exist "
        f"(expected latest, none, a step-<N> of this run's checkpoints or a path to one; {there})"
    )


def check_encoders(config: JobConfig) -> None:
    """encoding.text_encoder names "tiny-t5" or a folder that exists, even where the run does not load it (the
    checkpoints name it for sampling); the VAE validation decodes with exists and gives the model's channels."""
    try:
        check_text_encoder_name(config.encoding.text_encoder)
    except FileNotFoundError as exc:
        raise config.error(f"encoding.text_encoder: {exc}") from None
    vae, key = config.validation.vae_setting(config.encoding) if config.validation.enable else ("", "")
    if not vae:
        return
    try:
        channels = folder_latent_channels(vae)
    except (OSError, ValueError) as exc:
        raise config.error(f"{key} = {vae!r}: the validation VAE cannot be loaded: {exc}") from None
    in_channels = model_config(config.model.name, config.model.overrides).in_channels
    if channels != in_channels:
        raise config.error(
            f"{key} = {vae!r} (the VAE validation decodes its samples with) has {channels} latent channels; "
            f"model.name = {config.model.name!r} takes {in_channels} (model.in_channels): name the VAE the "
            'data is encoded with, or set validation.vae = "none"'
        )


def _importable(module: str) -> bool:
    """Whether `module` is installed, found without importing it (wandb takes seconds to import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (blocked) raises ValueError
        return False


def check_trackers(config: JobConfig) -> None:
    """The optional trackers the run logs to are installed."""
    if config.metrics.enable_wandb and not _importable("wandb"):
        raise config.error(
            "metrics.enable_wandb = true needs the wandb package, which is not installed here: "
            "pip install 'sana2[wandb]' (or pip install wandb), or set metrics.enable_wandb = false"
        )


def check_inputs_exist(config: JobConfig) -> None:
    """The dataset folders and the initial weights the run reads exist (their content is checked when they are
    read; online mode's data.inputs are listed, and checked, when the data is built)."""
    data, dataset = config.data, "a feature dataset folder (sana2-prepare's --output)"
    digits = data.mode == "precomputed" and data.path == "digits"  # brings its own held-out set
    named = []
    if data.mode == "precomputed" and not digits:
        named.append(("data.path", data.path, f'{dataset}, or "digits"'))
    if data.val_path and not digits:
        named.append(("data.val_path", data.val_path, f'{dataset}, or "" for none'))
    if data.mode == "precomputed" and data.image_path and config.training.joint_training_interval:
        named.append(("data.image_path", data.image_path, dataset))
    if config.checkpoint.initial_load_path:
        named.append(("checkpoint.initial_load_path", config.checkpoint.initial_load_path, "a checkpoint or model"))
    for key, value, expected in named:
        if not Path(value).exists():
            raise config.error(f"{key} = {value!r}: no such file or folder (expected {expected})")


def check_run(config: JobConfig, world_size: int, device_type: str = "cpu") -> tuple[ParallelDims, BatchSizes]:
    """Every check that can run before the workers start: the degrees against the world size, the batch
    sizes against the data-parallel size, the encoders and inputs it names, the checkpoint to resume, and that the
    run's outputs stay apart from its inputs. Returns the degrees (their mesh is built on first use) and the
    per-rank batch sizes."""
    dims = ParallelDims.from_config(config, world_size, device_type)
    batch = resolve_batch(config, dims.dp_size)
    if dims.cp > 1 and config.training.joint_training_interval:
        # an image is one frame: it cannot be split over the cp ranks
        raise config.error(
            "parallelism.context_parallel_degree > 1 with training.joint_training_interval: image batches "
            "cannot be split over frames; set one of them off"
        )
    build_transforms(config)  # the model transforms' names and settings
    check_encoders(config)
    check_trackers(config)
    check_inputs_exist(config)
    check_resume_from(config)
    check_outputs_apart(config)
    return dims, batch


def check_main(argv: list[str] | None = None) -> int:
    """`python -m sana2.preflight --world-size N CONFIG [overrides]`: the checks the launcher makes
    before starting workers (sana2/launch.py), on their own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    try:
        check_run(main_config(argv), world_size)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(check_main())
