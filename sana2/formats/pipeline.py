"""A released diffusers Sana pipeline as a run's starting point: `[model] pretrained` / `--pretrained`.

A pipeline folder holds `model_index.json` and one folder per component: `transformer/` (a diffusers Sana
transformer), `vae/` (AutoencoderDC), `text_encoder/` with `tokenizer/` beside it (Gemma-2), `scheduler/`
(`scheduler_config.json`). `pipeline_defaults` turns it into run-config values, each under its own key, so
that any key the user sets keeps the user's value:

    model.name and its keywords    the transformer's config (sana2/formats/diffusers.py's translation)
    checkpoint.initial_load_path   transformer/ (its weights are the initial load when not resuming)
    encoding.text_encoder          text_encoder/ (its tokenizer is tokenizer/ beside it)
    encoding.vae, validation.vae   vae/
    model.model_max_length         300, SanaPipeline's max_sequence_length (the caption length)
    training.flow_shift            the scheduler's flow shift
    validation.scheduler           dpm-solver or euler, as the scheduler's class
    validation.cfg_scale           4.5, SanaPipeline's guidance scale

`pretrained` is a local folder, or a Hugging Face Hub id fetched with `huggingface_hub.snapshot_download`
(only the local cache when HF_HUB_OFFLINE is set).
"""

import json
import re
from pathlib import Path
from typing import Any

from sana2.formats.diffusers import DiffusersFormatError, sana2_model
from sana2.formats.diffusers_folder import read_config

MODEL_INDEX = "model_index.json"
SCHEDULER_CONFIG = "scheduler/scheduler_config.json"
PIPELINE_CAPTION_LENGTH = 300  # SanaPipeline's max_sequence_length
PIPELINE_CFG_SCALE = 4.5  # SanaPipeline's guidance_scale
SCHEDULER_NAMES = {"DPMSolverMultistepScheduler": "dpm-solver", "FlowMatchEulerDiscreteScheduler": "euler"}
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def is_pipeline_folder(path: Path) -> bool:
    return (Path(path) / MODEL_INDEX).is_file()


def pipeline_root(checkpoint: Path) -> Path | None:
    """The pipeline folder `checkpoint` is (its root) or lies in (its transformer/ folder), else None."""
    if is_pipeline_folder(checkpoint):
        return checkpoint
    if checkpoint.name == "transformer" and is_pipeline_folder(checkpoint.parent):
        return checkpoint.parent
    return None


def resolve_pipeline(pretrained: str) -> Path:
    """The local pipeline folder `pretrained` names: a path, or a Hub id downloaded (or read from the cache)."""
    path = Path(pretrained).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(pretrained):
        path = _from_hub(pretrained)
    if not path.is_dir():
        raise ValueError(f"{pretrained}: no such folder (expected a diffusers pipeline folder or a Hub id)")
    if not is_pipeline_folder(path):
        raise ValueError(f"{path}: not a diffusers pipeline folder (expected {MODEL_INDEX} and transformer/)")
    return path


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:  # huggingface_hub's errors: offline, not cached, no such repository, no network
        where = "the local cache (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub"
        raise ValueError(f"{repo_id}: not a local folder, and {where} does not give it: {exc}") from None


def pipeline_defaults(pretrained: str) -> dict[str, Any]:
    """Run-config values ("section.key" -> value) for the pipeline `pretrained` (module docstring)."""
    root = resolve_pipeline(pretrained)
    transformer = root / "transformer"
    config = read_config(transformer)
    if config is None:
        raise ValueError(f"{transformer}: expected a diffusers Sana transformer folder (config.json and weights)")
    try:
        name, kwargs = sana2_model(config)
    except DiffusersFormatError as exc:
        raise ValueError(f"{transformer}: {exc}") from None
    values: dict[str, Any] = {"model.name": name}
    values.update({f"model.{key}": value for key, value in kwargs.items()})
    values["model.model_max_length"] = PIPELINE_CAPTION_LENGTH
    values["checkpoint.initial_load_path"] = str(transformer)
    if (root / "text_encoder").is_dir():
        values["encoding.text_encoder"] = str(root / "text_encoder")
    if (root / "vae").is_dir():
        values["encoding.vae"] = values["validation.vae"] = str(root / "vae")
    values.update(scheduler_defaults(root))
    values["validation.cfg_scale"] = PIPELINE_CFG_SCALE
    return values


def scheduler_defaults(root: Path) -> dict[str, Any]:
    """training.flow_shift and validation.scheduler from the pipeline's scheduler config (none without one)."""
    path = root / SCHEDULER_CONFIG
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from None
    kind = SCHEDULER_NAMES.get(config.get("_class_name"))
    if kind is None:
        raise ValueError(
            f"{path}: scheduler {config.get('_class_name')!r}; sana2 samples with {' or '.join(SCHEDULER_NAMES)}"
        )
    shift = config.get("flow_shift", config.get("shift", 1.0))
    return {"training.flow_shift": float(shift), "validation.scheduler": kind}
