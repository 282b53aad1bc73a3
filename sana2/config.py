"""Typed run configuration: TOML file -> dataclasses, with `--section.key=value` overrides.

Every section mirrors one component; every field has a typed default, its allowed values (a Literal
type, or a check in its section's __post_init__) and a line saying what it does. Unknown sections or
keys, wrong types and impossible values stop the run before any work with a `ConfigError` naming
the key, the file and what is allowed; the components trust what the config guarantees.
"""

import dataclasses
import json
import os
import re
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sana2 import staging
from sana2.cli import dtype_name
from sana2.log import logger


class ConfigError(ValueError):
    """A configuration problem a user must fix; the message names the key and what is allowed."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _positive(section: str, values: dict[str, float]) -> None:
    for name, value in values.items():
        _check(value > 0, f"{section}.{name} must be > 0")


def _non_negative(section: str, values: dict[str, float]) -> None:
    for name, value in values.items():
        _check(value >= 0, f"{section}.{name} must be >= 0")


def _below_one(section: str, values: dict[str, float]) -> None:
    """A probability or decay: 1 would drop every caption or freeze the average."""
    for name, value in values.items():
        _check(0 <= value < 1, f"{section}.{name} = {value} must be in [0, 1)")


# Each section's __post_init__ checks its own fields (a check that involves two sections is in
# JobConfig's). Choices are Literal types, which loading checks.


@dataclass
class Job:
    dump_folder: str = "./outputs/debug"
    """Checkpoints, TensorBoard logs and the resolved config go here; one run at a time owns it."""
    description: str = ""
    stop_grace_period: float = 60.0
    """Seconds between a stop signal (SIGTERM or SIGINT to the launcher, e.g. a scheduler's preemption)
    and the kill that follows it: the run stops at the next safe point and its checkpoint must land
    within this time. Match it to the scheduler's (Slurm KillWait or --signal, Kubernetes
    terminationGracePeriodSeconds)."""

    def __post_init__(self):
        _positive("job", {"stop_grace_period": self.stop_grace_period})


@dataclass
class Model:
    name: str = "SanaMS_digits"
    """A registry name (sana2/models/registry.py) or a model class name."""
    pretrained: str = ""
    """A diffusers Sana pipeline folder or Hub id to start from (sana2/formats/pipeline.py): its transformer's
    weights (the initial load), VAE, text encoder and scheduler's flow shift, each a default its own key overrides."""
    overrides: dict = field(default_factory=dict)
    """Every other key of [model]: a constructor keyword, checked by the model registry."""


@dataclass
class Data:
    mode: Literal["precomputed", "online"] = "precomputed"
    """precomputed: read features from `path`; online: read the images and captions of `inputs` and encode
    them in the step as [encoding] says (docs/data_preparation.md)."""
    path: str = "digits"
    """Precomputed mode: a dataset folder in the feature format (sana2/data/features.py), or "digits": the
    embedded 8x8 handwritten digits, built on first use under <dump_folder>/../data."""
    val_path: str = ""
    """A held-out dataset in the feature format for the validation loss ("digits" brings its own)."""
    inputs: list[str] = field(default_factory=list)
    """Online mode: image folders, JSONL manifests, .tar shards or folders of them (sana2-prepare's inputs)."""
    image_path: str = ""
    """Image-video joint training (training.joint_training_interval > 0), precomputed mode: the image
    features, prepared through the same VAE (the Wan VAE makes one-frame latents [C, 1, h, w])."""
    image_inputs: list[str] = field(default_factory=list)
    """Joint training, online mode: the image folders, manifests or shards, encoded in the step."""
    image_buckets: str = ""
    """Joint training, online mode: the images' aspect-ratio table (default: encoding.buckets)."""

    def __post_init__(self):
        _check(
            self.mode != "online" or bool(self.inputs),
            "data.inputs must list the image folders, manifests or shards to encode",
        )


def available_cores() -> int:
    """The cores this process may run on (its affinity: taskset, cgroups' cpusets), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(per_rank: int = 2) -> int:
    """`per_rank` decoding workers, fewer where the ranks of this node (torchrun's LOCAL_WORLD_SIZE) would
    together get more than its cores: never more workers than cores, so the data loader has no cause to warn."""
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return min(per_rank, available_cores() // ranks)


@dataclass
class Encoding:
    """How images and captions become features: `sana2-prepare`'s settings (its flags, or this section of a
    config it is given) and online mode's, with one set of defaults. The same inputs and settings give the same
    samples, buckets, captions and features either way (up to the dtype prepare stores them in)."""

    text_encoder: str = "tiny-t5"
    """Either "tiny-t5" (built from a config, no download) or a local model folder (Gemma-2, T5); encodes
    the validation prompts, and in online mode the captions."""
    instruction: str = "auto"
    """Caption prefix of a decoder-only text encoder: "auto" (Sana's for Gemma-2, none for T5), "none", or
    the text itself."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights of the frozen text encoder and VAE (Sana: bfloat16; also bf16, fp32). float32 by default: bf16
    is several times slower on CPUs without bf16 instructions, and features in fp32 are exact."""
    vae: str = ""
    """A local diffusers autoencoder folder, or "none" (pixels in [-1, 1] are the latents); online mode and
    sana2-prepare need one."""
    posterior: Literal["mode", "sample"] = "mode"
    """A KL VAE's latent: its posterior's mean ("mode"), or a sample drawn per image from `seed`."""
    buckets: str = "ASPECT_RATIO_512"
    """Sana's aspect-ratio table (ASPECT_RATIO_256, _512, _1024, ...) or one size "HxW"."""
    caption_proportion: dict = field(default_factory=lambda: {"prompt": 1.0})
    """Caption type -> weight, Sana's caption proportions; each sample draws one type."""
    caption_suffixes: list[str] = field(default_factory=lambda: [""])
    """Suffixes of caption side files <stem><suffix>.json."""
    seed: int = 0
    """Seeds each sample's caption choice and a sampled posterior."""
    min_size: int = 0
    """Images whose shorter side is below this are skipped (and reported)."""
    shard_text_encoder: bool = True
    """Shard the frozen text encoder over the ranks (each holds 1/N of it)."""
    workers: int = field(default_factory=lambda: default_workers())
    """Image-decoding worker processes per rank (online mode: threads for the images of a step); by default 2,
    fewer where this node's ranks would together get more than its cores (default_workers)."""
    num_frames: int = 0
    """0: the inputs are images; 4k + 1 (Sana-Video: 81): the inputs are clips (folders of clips, JSONL
    manifests, Sana's zips; docs/video.md), this many frames each, through the Wan VAE."""
    fps: float = 16.0
    """Clips: the frame rate they are resampled to (Sana-Video: 16)."""
    frame_start: Literal["first", "center"] = "first"
    """Clips: where a clip's frames start: its first frame, or the middle window."""
    motion_score: Literal["average", "max", "none"] = "average"
    """Sana zips: how a clip's motion scores (<zip>_unimatch.json) make the one appended to its caption."""
    vae_tiling: bool = False
    """The Wan VAE encodes each frame in tiles (less memory, slightly other numbers)."""

    def __post_init__(self):
        _non_negative("encoding", {"min_size": self.min_size, "workers": self.workers})
        weights = self.caption_proportion.values()
        _check(
            bool(self.caption_proportion)
            and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights)
            and sum(weights) > 0,
            "encoding.caption_proportion must map caption types to weights >= 0, not all 0; "
            f"got {self.caption_proportion}",
        )
        try:
            self.window()
        except ValueError as exc:
            raise ConfigError(f"encoding.num_frames / encoding.fps: {exc}") from None
        from sana2.data.buckets import parse_buckets

        try:
            parse_buckets(self.buckets)
        except ValueError as exc:
            raise ConfigError(f"encoding.buckets: {exc}") from None

    def window(self):
        """The frames each clip gives (sana2.data.frame_window.FrameWindow), or None: the inputs are images."""
        from sana2.data.frame_window import FrameWindow

        return FrameWindow(self.num_frames, self.fps, self.frame_start) if self.num_frames else None

    def settings(self) -> dict:
        """What decides the features (not workers or sharding): part of a dataset plan's fingerprint."""
        settings = dataclasses.asdict(self)
        for key in ("shard_text_encoder", "workers"):
            settings.pop(key)
        return settings


# [data] keys that moved to [encoding]: named in the message of a config that still sets them
MOVED_KEYS = {
    "data.text_encoder": "encoding.text_encoder",
    "data.instruction": "encoding.instruction",
    "data.encoder_dtype": "encoding.dtype",
    "data.vae": "encoding.vae",
    "data.buckets": "encoding.buckets",
    "data.caption_proportion": "encoding.caption_proportion",
    "data.caption_suffixes": "encoding.caption_suffixes",
    "data.caption_seed": "encoding.seed",
    "data.min_size": "encoding.min_size",
    "data.shard_text_encoder": "encoding.shard_text_encoder",
    "data.workers": "encoding.workers",
    "data.num_frames": "encoding.num_frames",
    "data.fps": "encoding.fps",
    "data.frame_start": "encoding.frame_start",
    "data.motion_score": "encoding.motion_score",
}


@dataclass
class Optimizer:
    name: Literal["adamw", "came"] = "adamw"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Each in [0, 1): two for adamw, three for came (e.g. [0.9, 0.999, 0.9999])."""
    eps: list[float] = field(default_factory=lambda: [1e-8])
    """Each > 0: one for adamw, two for came (e.g. [1e-30, 1e-16])."""

    def __post_init__(self):
        _positive("optimizer", {"lr": self.lr})
        _non_negative("optimizer", {"weight_decay": self.weight_decay})
        _check(all(0 <= b < 1 for b in self.betas), f"optimizer.betas must each be in [0, 1), got {self.betas}")
        _check(all(e > 0 for e in self.eps), f"optimizer.eps must each be > 0, got {self.eps}")
        betas, eps = {"adamw": (2, 1), "came": (3, 2)}[self.name]
        _check(
            (len(self.betas), len(self.eps)) == (betas, eps),
            f"optimizer.betas must have {betas} values and optimizer.eps {eps} value{'s' * (eps > 1)} for {self.name}",
        )


@dataclass
class LRScheduler:
    warmup_steps: int = 0
    """The lr rises linearly from 0 over this many steps."""
    decay_type: Literal["constant", "cosine", "linear"] = "constant"
    """After warmup: hold, or decay to min_lr_ratio x lr at training.steps."""
    min_lr_ratio: float = 0.0
    """In [0, 1]: 1 means no decay."""

    def __post_init__(self):
        _non_negative("lr_scheduler", {"warmup_steps": self.warmup_steps})
        _check(0 <= self.min_lr_ratio <= 1, f"lr_scheduler.min_lr_ratio = {self.min_lr_ratio} must be in [0, 1]")


@dataclass
class Training:
    local_batch_size: int = 32
    """Samples per rank per micro-batch; derived from global_batch_size when that is set."""
    global_batch_size: int = 0
    """When > 0: samples per optimizer step over all ranks and micro-batches."""
    gradient_accumulation_steps: int = 1
    max_norm: float = 1.0
    """Gradient clipping by the global norm; 0 disables it (the norm is still logged)."""
    steps: int = 100
    seed: int = 0
    """Seeds the initialisation, the data order and every sample's noise (sana2/seeding.py)."""
    # no float16: it needs a gradient scaler, and bfloat16 does the same job without one
    mixed_precision_param: Literal["float32", "bfloat16"] = "bfloat16"
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    flow_shift: float = 1.0
    """The resolution-dependent shift of the noise levels (> 0; 1: none)."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    """Noise levels are drawn logit-normal with this mean and standard deviation."""
    caption_dropout: float = 0.1
    """Probability of replacing a caption by the null caption (classifier-free guidance), in [0, 1)."""
    ema_decay: float = 0.0
    """In [0, 1); 0 disables the EMA of the weights."""
    max_consecutive_nonfinite: int = 10
    """Steps with a non-finite loss or gradient norm are skipped; this many in a row stop the run."""
    joint_training_interval: int = 0
    """Image-video joint training as Sana's ivjoint trainer: after n steps, the next is a whole image batch
    when n is a positive multiple of this (data.image_path / data.image_inputs); 0 turns it off."""
    image_local_batch_size: int = 4
    """Joint training: images per rank per micro-batch of an image step (Sana: train_batch_size_image = 4);
    derived from image_global_batch_size when that is set."""
    image_global_batch_size: int = 0
    """Joint training, when > 0: images per image step over all ranks and micro-batches."""

    def __post_init__(self):
        _positive(
            "training",
            {
                "local_batch_size": self.local_batch_size,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "steps": self.steps,
                "flow_shift": self.flow_shift,
                "max_consecutive_nonfinite": self.max_consecutive_nonfinite,
            },
        )
        _non_negative(
            "training",
            {"global_batch_size": self.global_batch_size, "max_norm": self.max_norm, "logit_std": self.logit_std},
        )
        _non_negative(
            "training",
            {
                "joint_training_interval": self.joint_training_interval,
                "image_global_batch_size": self.image_global_batch_size,
            },
        )
        _positive("training", {"image_local_batch_size": self.image_local_batch_size})
        _below_one("training", {"caption_dropout": self.caption_dropout, "ema_decay": self.ema_decay})


# diffusers' Sana LoRA script's to_q, to_k, to_v of both attentions, in Sana's fused layers (sana2/components/lora.py)
LORA_TARGETS = ["attn.qkv", "cross_attn.q_linear", "cross_attn.kv_linear"]


@dataclass
class Lora:
    """The "lora" model transform's settings (model_transforms.names = ["lora"]): low-rank adapters (peft) trained
    on a frozen base instead of every weight (docs/finetuning.md)."""

    rank: int = 32
    alpha: float = 0.0
    """The adapters' scale is alpha / rank; 0: the rank (scale 1, as diffusers' Sana script)."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """sana2 linear layers by name suffix (attn.qkv, attn.proj, cross_attn.q_linear, ...) or diffusers' names
    (to_q, to_k, to_v, to_out.0, attn1.to_q, ...)."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""

    def __post_init__(self):
        _positive("lora", {"rank": self.rank})
        _non_negative("lora", {"alpha": self.alpha})
        _below_one("lora", {"dropout": self.dropout})
        _check(bool(self.target_modules), "lora.target_modules must name at least one module")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """Ranks one parameter is sharded over; -1: world size / replicate degree."""
    data_parallel_replicate_degree: int = 1
    """> 1: hybrid sharding (HSDP), replicas of the sharded model on a 2-D mesh."""
    context_parallel_degree: int = 1
    """> 1: each group of this many ranks splits one clip's frames (video models; 1 = off). FSDP shards
    over the data-parallel shard and cp ranks together; data is split over the data-parallel ranks only."""
    reshard_after_forward: bool = True
    """False keeps parameters gathered between forward and backward (like SHARD_GRAD_OP)."""
    cpu_offload: bool = False

    def __post_init__(self):
        _positive(
            "parallelism",
            {
                "data_parallel_replicate_degree": self.data_parallel_replicate_degree,
                "context_parallel_degree": self.context_parallel_degree,
            },
        )


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = "none"
    """Recompute in backward: no block, every block, or every selective_every-th block."""
    selective_every: int = 2

    def __post_init__(self):
        _positive("activation_checkpoint", {"selective_every": self.selective_every})


@dataclass
class ModelTransforms:
    names: list[str] = field(default_factory=list)
    """Transforms applied in this order to the model built on meta, before it is parallelised
    (sana2/components/model_transforms.py lists them): "freeze" (parameters that do not train), "lora"
    (adapters on a frozen base, set up by [lora])."""
    freeze: list[str] = field(default_factory=list)
    """"freeze": patterns (fnmatch) of parameter names that do not train, e.g. "blocks.*.mlp.*"."""


@dataclass
class Compile:
    enable: bool = False
    """torch.compile each transformer block."""


@dataclass
class Checkpoint:
    enable: bool = True
    folder: str = "checkpoint"
    """Under job.dump_folder."""
    interval: int = 500
    keep_latest_k: int = 3
    """0 keeps all."""
    async_mode: Literal["disabled", "async"] = "disabled"
    resume_from: str = "latest"
    """Either "latest" (the newest complete checkpoint, if any), "none", or a checkpoint folder: a
    name such as step-200 is looked up in this run's checkpoint folder, a path is taken as it is."""
    initial_load_path: str = ""
    """A full-model file or a DCP folder to start from when not resuming (model weights only)."""

    def __post_init__(self):
        _positive("checkpoint", {"interval": self.interval})
        _non_negative("checkpoint", {"keep_latest_k": self.keep_latest_k})


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    enable_wandb: bool = False
    """Also log to Weights & Biases (the same scalars and images), under <dump_folder>/wandb/: needs the wandb
    package (pip install 'sana2[wandb]') and a login, or WANDB_MODE=offline to keep the run on disk."""
    wandb_project: str = "sana2"
    """The Weights & Biases project the run is logged to."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0: sana2's table of GPUs on CUDA, no MFU on CPU."""
    slow_data_warning: float = 0.2
    """Warn when waiting for data takes more than this share of the step time."""

    def __post_init__(self):
        _positive("metrics", {"log_freq": self.log_freq})
        _non_negative("metrics", {"peak_flops": self.peak_flops})
        # whether wandb is installed is the run's pre-launch check (sana2/preflight.py), not the config's: a
        # machine without it must still sample, convert and plan a run that logged to it


@dataclass
class Validation:
    enable: bool = True
    freq: int = 100
    at_start: bool = True
    prompts: list[str] = field(default_factory=lambda: ["digit zero", "the number 3", "a drawn seven", "handwritten 9"])
    """Sampled every freq steps; embedded as the data's captions are, so keep them within
    model.model_max_length tokens (bytes for tiny-t5)."""
    images_per_prompt: int = 2
    sampling_steps: int = 20
    cfg_scale: float = 4.0
    scheduler: Literal["dpm-solver", "euler"] = "dpm-solver"
    """diffusers' scheduler the samples are drawn with (sana2/components/schedulers.py): DPM-Solver multistep on
    flow sigmas, as SanaPipeline; or flow-matching Euler (FlowMatchEulerDiscreteScheduler)."""
    seed: int = 0
    """Seeds the sampling noise and the held-out loss's noise."""
    use_ema: bool = False
    loss_sigmas: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    """The noise levels (each in [0, 1]) the held-out loss is evaluated at."""
    num_loss_samples: int = 64
    vae: str = ""
    """A local diffusers autoencoder folder that decodes the samples to RGB before they are logged; "": the
    one the data is encoded with (encoding.vae), if any; "none": none (the latents are shown as they are)."""

    def __post_init__(self):
        _positive(
            "validation",
            {"freq": self.freq, "sampling_steps": self.sampling_steps, "images_per_prompt": self.images_per_prompt},
        )
        _non_negative("validation", {"num_loss_samples": self.num_loss_samples})
        _check(
            all(0 <= s <= 1 for s in self.loss_sigmas),
            f"validation.loss_sigmas must each be in [0, 1], got {self.loss_sigmas}",
        )
        _check(
            not self.enable or len(self.prompts) > 0,
            f"validation.prompts must be a non-empty list of strings, got {self.prompts!r}",
        )

    def vae_setting(self, encoding: Encoding) -> tuple[str, str]:
        """The VAE that decodes the samples and the key that names it: validation.vae, else the one the data is
        encoded with (encoding.vae); "" (no VAE: latents are shown as they are) where that value is "" or "none"."""
        key = "validation.vae" if self.vae else "encoding.vae"
        vae = self.vae or encoding.vae
        return ("" if vae == "none" else vae), key


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    encoding: Encoding = field(default_factory=Encoding)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    lora: Lora = field(default_factory=Lora)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    model_transforms: ModelTransforms = field(default_factory=ModelTransforms)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    source: str = "<defaults>"
    """The TOML file the values came from (for messages)."""
    command_line: dict[str, str] = field(default_factory=dict)
    """"section.key" -> the command-line override that set it (for messages)."""

    def __post_init__(self):
        """The checks that span sections."""
        sched, steps = self.lr_scheduler, self.training.steps
        _check(
            sched.decay_type == "constant" or steps > sched.warmup_steps,
            f"training.steps = {steps} must exceed lr_scheduler.warmup_steps = {sched.warmup_steps} "
            f"for {sched.decay_type} decay",
        )
        _check(
            self.data.mode != "online" or bool(self.encoding.vae),
            'encoding.vae must name a local autoencoder folder, or "none" for pixel space (data.mode = "online")',
        )
        from sana2.models import MODELS, ModelConfigError, model_config

        try:
            model_config(self.model.name, self.model.overrides)
        except ModelConfigError as exc:
            named = "" if self.model.name in MODELS else f"model.name = {self.model.name!r}: "
            raise ConfigError(f"[model] {named}{exc}") from None
        if self.training.joint_training_interval:
            data = self.data
            source = data.image_inputs if data.mode == "online" else data.image_path
            _check(
                bool(source),
                "training.joint_training_interval > 0 needs the images: data.image_path (precomputed) or "
                "data.image_inputs (online)",
            )

    def error(self, message: str, keys: tuple[str, ...] = ()) -> ConfigError:
        """A ConfigError saying `message`, led by where the values it names came from: the
        command-line overrides it names, else those of `keys` (the settings behind a mismatch the
        message states in other words, e.g. the model and the data), else the TOML file."""
        origin = _origin(message, self.source, self.command_line)
        if origin == self.source and keys:
            origin = _origin(" ".join(keys), self.source, self.command_line)
        return ConfigError(f"{origin}: {message}")

    @property
    def caption_length(self) -> int:
        """Tokens per caption: the model's model_max_length. The text encoder pads or cuts every caption to it
        (prepare, online mode, validation and sampling), and the data's captions must have it."""
        from sana2.models import model_config

        return model_config(self.model.name, self.model.overrides).model_max_length

    @property
    def checkpoint_folder(self) -> Path:
        return Path(self.job.dump_folder) / self.checkpoint.folder

    def resume_target(self) -> str | Path:
        """ "latest", "none", or the absolute path of the checkpoint folder checkpoint.resume_from names
        (a bare name such as step-200 lies in this run's checkpoint folder)."""
        value = self.checkpoint.resume_from
        if value in ("latest", "none"):
            return value
        path = Path(value)
        if len(path.parts) == 1:
            path = self.checkpoint_folder / path
        return path.absolute()

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("command_line")
        model = out["model"]
        model.update(model.pop("overrides"))
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_toml(self) -> str:
        """The resolved config as a TOML file that reproduces this run."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted, as caption types may hold any character
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # numbers and double-quoted strings are valid TOML


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig) if f.name not in ("source", "command_line")}


def _mentions(message: str, key: str) -> bool:
    """Whether `message` names the config key "section.name" (model keywords are also named bare)."""
    section, name = key.split(".", 1)
    names = [key, name] if section == "model" else [key]
    return any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", message) for n in names)


def _origin(message: str, source: str, command_line: dict[str, str]) -> str:
    """Where the values `message` names came from: the command-line overrides it names, else the file."""
    named = [text for key, text in command_line.items() if _mentions(message, key)]
    return f"command-line override{'s' * (len(named) > 1)} {', '.join(named)}" if named else source


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(value: Any, expected: Any, where: str) -> Any:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
    origin = typing.get_origin(expected)
    if origin is Literal:
        allowed = typing.get_args(expected)
        if isinstance(value, str) and dtype_name(value) in allowed:  # a dtype may be spelled bf16, fp32, ...
            return dtype_name(value)
        raise ConfigError(f"{where} = {value!r} is not allowed; choose one of {allowed}")
    if origin is list:
        (item,) = typing.get_args(expected)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {item.__name__}, got {type(value).__name__} {value!r}")
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, expected) and not (expected in (int, float) and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {expected.__name__}, got {type(value).__name__} {value!r}")


def _parse_override(text: str) -> tuple[str, str, Any]:
    if not text.startswith("--") or "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"command-line override {text!r}: expected --section.key=value")
    key, raw = text[2:].split("=", 1)
    section, name = key.split(".", 1)
    try:  # a TOML literal: numbers, booleans, quoted strings, [lists]
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare string
    return section, name, value


# the presets that ship with sana2 (package data): `sana2-train sana_600m_img512` trains one from any directory
PRESET_FOLDER = Path(__file__).resolve().parent / "train_configs"
PRESETS = {path.stem: path for path in PRESET_FOLDER.glob("*.toml")}


def preset_path(path: str | Path) -> Path:
    """`path` itself where it is a file, else the preset it names (with or without .toml)."""
    name = Path(path).name.removesuffix(".toml")
    if not Path(path).is_file() and len(Path(path).parts) == 1 and name in PRESETS:
        return PRESETS[name]
    return Path(path)


def load_config(path: str | Path | None = None, overrides: list[str] = (), pretrained=None) -> JobConfig:
    """Read a TOML file (or defaults when None), apply overrides, validate everything.

    `pretrained`: a function of model.pretrained giving {"section.key": value} defaults for the keys neither
    the file nor an override sets (the commands pass sana2.formats.pipeline.pipeline_defaults; the model's
    keywords only when model.name is not set). A ConfigError names where the offending values came from:
    the command-line override that set them (`--training.steps=0`), else the file.
    """
    path = preset_path(path) if path else path
    source = str(path) if path else "<defaults>"
    raw: dict[str, dict] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            presets = ", ".join(sorted(PRESETS))
            raise ConfigError(f"config file {source} does not exist (nor is it a preset: {presets})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {source} is not valid TOML: {exc}") from None
    command_line: dict[str, str] = {}
    for text in overrides:
        section, name, value = _parse_override(text)
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(
                f"command-line override {text}: {source} sets {section} = a value, not a [{section}] table"
            )
        raw.setdefault(section, {})[name] = value
        command_line[f"{section}.{name}"] = text
    _read_caption_length(raw, source, command_line)
    if pretrained is not None and isinstance(raw.get("model"), dict) and raw["model"].get("pretrained"):
        _apply_pretrained(raw, pretrained, source, command_line)
    sections = _sections()
    for section, values in raw.items():
        if section not in sections:
            given = [text for key, text in command_line.items() if key.startswith(f"{section}.")]
            where = f"command-line override {given[0]}" if given else source
            raise ConfigError(f"{where}: unknown section [{section}]; allowed: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of keys")
    try:
        built = {section: _build_section(cls, section, raw.get(section, {})) for section, cls in sections.items()}
        return JobConfig(**built, source=source, command_line=command_line)
    except ConfigError as exc:
        raise ConfigError(f"{_origin(str(exc), source, command_line)}: {exc}") from None


def _read_caption_length(raw: dict, source: str, command_line: dict[str, str]) -> None:
    """data.caption_length, the caption length's key before it became the model's: read as model.model_max_length
    (configs and checkpoints' config.toml written before keep working), with a line saying so."""
    data, model = raw.get("data"), raw.setdefault("model", {})
    if not isinstance(data, dict) or "caption_length" not in data or not isinstance(model, dict):
        return
    value = data.pop("caption_length")
    override = command_line.pop("data.caption_length", None)
    where = f"command-line override {override}" if override else source
    if model.get("model_max_length", value) != value:
        given = command_line.get("model.model_max_length")
        raise ConfigError(
            f"{where}: data.caption_length = {value!r} contradicts model.model_max_length = "
            f"{model['model_max_length']!r} ({f'command-line override {given}' if given else source}): they are "
            "one setting, model.model_max_length; drop data.caption_length"
        )
    model["model_max_length"] = value
    if override:  # messages about the length name the override that set it
        command_line.setdefault("model.model_max_length", override)
    logger.warning(f"{where}: data.caption_length is deprecated; read as model.model_max_length = {value!r}")


def _apply_pretrained(raw: dict, pretrained, source: str, command_line: dict[str, str]) -> None:
    """Fill the keys raw leaves unset with the pretrained pipeline's values."""
    name = raw["model"]["pretrained"]
    try:
        values = pretrained(name)
    except ValueError as exc:
        where = command_line.get("model.pretrained", source)
        raise ConfigError(f"{where}: model.pretrained = {name!r}: {exc}") from None
    own_model = "name" in raw["model"]
    for key, value in values.items():
        section, key_name = key.split(".", 1)
        if section == "model" and own_model:
            continue  # another model than the pipeline's: its keywords are the user's
        if isinstance(raw.setdefault(section, {}), dict):
            raw[section].setdefault(key_name, value)


def _build_section(cls: type, section: str, values: dict[str, Any]):
    """One section from its TOML table: keys known, types checked, then its own __post_init__ checks."""
    types_ = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if section == "model" and name not in types_:
            kwargs.setdefault("overrides", {})[name] = value
        elif f"{section}.{name}" in MOVED_KEYS:
            raise ConfigError(f"{section}.{name} is now {MOVED_KEYS[f'{section}.{name}']} (the [encoding] section)")
        elif name not in types_:
            raise ConfigError(f"unknown key {section}.{name}; allowed: {', '.join(types_)}")
        else:
            kwargs[name] = _coerce(value, types_[name], f"{section}.{name}")
    return cls(**kwargs)


@dataclass(frozen=True)
class BatchSizes:
    """Per-rank batch sizes resolved against the data-parallel size; the config keeps what was written."""

    local: int
    """training.local_batch_size, or training.global_batch_size / (data ranks x accumulation steps)."""
    image_local: int
    """Joint training's image batch per rank, resolved the same way."""


def resolve_batch(config: JobConfig, dp_size: int) -> BatchSizes:
    """The per-rank batch sizes for `dp_size` data-parallel ranks (sana2/distributed/parallel_dims.py)."""
    t = config.training
    per_step = dp_size * t.gradient_accumulation_steps
    local, image_local = t.local_batch_size, t.image_local_batch_size
    if t.global_batch_size:
        if t.global_batch_size % per_step:
            raise config.error(
                f"training.global_batch_size = {t.global_batch_size} is not divisible by data-parallel ranks "
                f"(world size / context_parallel_degree) x training.gradient_accumulation_steps = {per_step}"
            )
        local = t.global_batch_size // per_step
    if t.joint_training_interval and t.image_global_batch_size:
        if t.image_global_batch_size % per_step:
            raise config.error(
                f"training.image_global_batch_size = {t.image_global_batch_size} is not divisible by data-parallel "
                f"ranks (world size / context_parallel_degree) x training.gradient_accumulation_steps = {per_step}"
            )
        image_local = t.image_global_batch_size // per_step
    return BatchSizes(local, image_local)


def check_outputs_apart(config: JobConfig) -> None:
    """The run writes into job.dump_folder and prunes its checkpoint folder (keep_latest_k): neither may
    hold what the run reads (sana2.staging's rule: no output is, contains or lies inside an input)."""
    inputs = [("data.path", config.data.path), ("data.val_path", config.data.val_path)]
    inputs += [("data.inputs", path) for path in config.data.inputs]
    inputs += [("checkpoint.initial_load_path", config.checkpoint.initial_load_path)]
    for key, value in inputs:
        if not value or not Path(value).exists():
            continue  # a name ("digits"), or missing: checked where it is read
        dump = staging.overlap(Path(config.job.dump_folder), Path(value))
        if dump in ("is", "lies inside"):
            raise config.error(
                f"job.dump_folder = {config.job.dump_folder!r} {dump} {key} = {value!r}: the run would write "
                "its checkpoints and logs among its inputs; choose a dump folder outside them"
            )
        pruned = config.checkpoint.keep_latest_k > 0
        if pruned and staging.overlap(config.checkpoint_folder, Path(value)) in ("is", "contains"):
            raise config.error(
                f"{key} = {value!r} lies in this run's checkpoint folder {config.checkpoint_folder}, whose "
                "old checkpoints the run deletes (checkpoint.keep_latest_k): copy it elsewhere or use another "
                "job.dump_folder"
            )


def main_config(argv: list[str] | None = None, pretrained=None) -> JobConfig:
    """`--job.config_file=PATH` (or the first positional argument) plus overrides (`pretrained`: load_config's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    rest = []
    for arg in argv:
        if arg.startswith("--job.config_file="):
            path = arg.split("=", 1)[1]
        elif not arg.startswith("--") and path is None:
            path = arg
        else:
            rest.append(arg)
    return load_config(path, rest, pretrained)
