"""--format diffusers-pipeline: a whole diffusers Sana pipeline folder, which `SanaPipeline.from_pretrained` loads
and sana2 takes back as `[model] pretrained` (sana2/formats/pipeline.py reads the same layout).

    <folder>/model_index.json   SanaPipeline's index of its components (diffusers' save_config)
             transformer/       the checkpoint's model, as --format diffusers writes it (streamed)
             vae/               the run's VAE folder (validation.vae, else encoding.vae), its files copied
             text_encoder/      the run's text encoder folder (encoding.text_encoder), its files copied
             tokenizer/         that encoder's tokenizer, saved by transformers
             scheduler/         the run's validation sampler on flow sigmas with its flow shift (SanaPipeline's
                                DPM-Solver multistep by default)

The components come from the step folder's config.toml, as sana2-sample of the folder builds them, so the
pipeline draws sana2-sample's image for the same seed and settings. A run without a VAE or text encoder
folder (the digits model: pixels and the in-process tiny-t5) has no pipeline to export, and is refused.
"""

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sana2.cli import CONFIG_TOML
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.diffusers import VIDEO_CLASS
from sana2.formats.tensors import CheckpointError
from sana2.tools.export import ExportPlan, export_diffusers

PIPELINE_CLASS = "SanaPipeline"


@dataclass(frozen=True)
class PipelineParts:
    """The folders and settings of the pipeline's components besides the transformer."""

    vae: Path
    text_encoder: Path
    tokenizer: Path
    scheduler: str  # sana2's name: "dpm-solver" or "euler"
    flow_shift: float

    @property
    def inputs(self) -> list[Path]:
        return [self.vae, self.text_encoder, self.tokenizer]

    @property
    def copied_bytes(self) -> int:
        return sum(path.stat().st_size for folder in (self.vae, self.text_encoder) for path in _files(folder))


def pipeline_parts(source: DcpCheckpoint, transformer_config: dict[str, Any]) -> PipelineParts:
    """The run's VAE, text encoder, tokenizer and sampler, from the step folder's config.toml; refused, naming
    what is missing, when the run has no folder diffusers could load for one of them."""
    from sana2.config import load_config
    from sana2.encoders.text_encoder import TINY_T5, tokenizer_folder
    from sana2.formats.pipeline import pipeline_defaults

    if transformer_config["_class_name"] == VIDEO_CLASS:
        raise CheckpointError(
            f"{source.folder} holds a video model: --format diffusers-pipeline writes {PIPELINE_CLASS} (image) "
            "folders; export the transformer with --format diffusers"
        )
    path = source.folder / CONFIG_TOML
    if not path.is_file():
        raise CheckpointError(
            f"{source.folder} has no {CONFIG_TOML}: the run's config, which names its VAE and text encoder"
        )
    config = load_config(path, [], pipeline_defaults)
    (vae, _), text_encoder = config.validation.vae_setting(config.encoding), config.encoding.text_encoder
    missing = []
    if not vae:
        missing.append(
            "no VAE folder (validation.vae and encoding.vae are unset or 'none': the model is in pixel space)"
        )
    if text_encoder == TINY_T5:
        missing.append(f"no text encoder folder (encoding.text_encoder = '{TINY_T5}' is built in-process)")
    if missing:
        raise CheckpointError(
            f"{path}: a {PIPELINE_CLASS} folder needs vae/ and text_encoder/, but the run names "
            f"{' and '.join(missing)}; export the transformer alone with --format diffusers"
        )
    for key, folder in (("validation.vae or encoding.vae", vae), ("encoding.text_encoder", text_encoder)):
        if not Path(folder).is_dir():
            raise CheckpointError(f"{path}: {key} = {folder!r} is not a folder")
    try:
        tokenizer = tokenizer_folder(Path(text_encoder))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return PipelineParts(
        Path(vae), Path(text_encoder), tokenizer, config.validation.scheduler, config.training.flow_shift
    )


def _files(folder: Path) -> list[Path]:
    """The files a model folder is made of (its top level: config, weights, index, tokenizer files)."""
    return sorted(path for path in folder.iterdir() if path.is_file() and not path.name.startswith("."))


def export_pipeline(
    plan: ExportPlan, target: Path, config: dict[str, Any], parts: PipelineParts, max_shard_bytes: int
) -> None:
    """Write the pipeline folder `target` (new): model_index.json and the five component folders."""
    from transformers import AutoTokenizer

    from sana2.components.schedulers import build_scheduler, scheduler_config

    target.mkdir()
    export_diffusers(plan, target / "transformer", config, max_shard_bytes)
    for name, folder in (("vae", parts.vae), ("text_encoder", parts.text_encoder)):
        (target / name).mkdir()
        for path in _files(folder):
            shutil.copyfile(path, target / name / path.name)
    tokenizer = AutoTokenizer.from_pretrained(parts.tokenizer, local_files_only=True)
    tokenizer.save_pretrained(target / "tokenizer")
    scheduler = build_scheduler(scheduler_config(parts.scheduler, parts.flow_shift))
    scheduler.save_pretrained(target / "scheduler")
    _pipeline_index(target, config, parts, tokenizer, scheduler)


def _pipeline_index(target: Path, config: dict[str, Any], parts: PipelineParts, tokenizer, scheduler) -> None:
    """model_index.json as diffusers writes it: a SanaPipeline of the components (the models built empty, on
    meta: only their classes are recorded) saves its config."""
    import diffusers

    from sana2.encoders.autoencoder import autoencoder_class
    from sana2.encoders.text_encoder import empty_text_encoder

    vae_class = autoencoder_class(parts.vae)
    with torch.device("meta"):
        transformer = getattr(diffusers, config["_class_name"]).from_config(config)
        vae = vae_class.from_config(vae_class.load_config(parts.vae))
    text_encoder = empty_text_encoder(parts.text_encoder, torch.float32)
    pipeline = getattr(diffusers, PIPELINE_CLASS)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer, scheduler=scheduler
    )
    pipeline.save_config(target)
