"""Typed run configuration: TOML file -> dataclasses, with `--section.key=value` overrides.

Every section mirrors one component; every field has a typed default. Unknown sections or keys,
wrong types and impossible values stop the run before any work with a `ConfigError` naming the
key, the file and what is allowed.
"""

import dataclasses
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli


class ConfigError(ValueError):
    """A configuration problem a user must fix; the message names the key and what is allowed."""


@dataclass
class Job:
    dump_folder: str = "./outputs/debug"
    description: str = ""


@dataclass
class Model:
    name: str = "SanaMS_digits"
    # every other key of [model] is a constructor keyword override, validated by the model registry
    overrides: dict = field(default_factory=dict)


@dataclass
class Data:
    # a dataset directory in sana2's feature format (sana2/components/data.py), or "digits": the
    # embedded 8x8 handwritten-digits set, built on first use under <dump_folder>/../data
    path: str = "digits"
    val_path: str = ""
    text_encoder: str = "tiny-t5"  # "tiny-t5" (built from a config) or a local model directory
    caption_length: int = 16


@dataclass
class Optimizer:
    name: str = "adamw"  # adamw | came
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: list = field(default_factory=lambda: [1e-8])  # came takes two: [1e-30, 1e-16]


@dataclass
class LRScheduler:
    warmup_steps: int = 0
    decay_type: str = "constant"  # constant | cosine | linear
    min_lr_ratio: float = 0.0


@dataclass
class Training:
    local_batch_size: int = 32
    # when > 0, the batch per optimizer step over all ranks; local_batch_size is derived from it
    global_batch_size: int = 0
    gradient_accumulation_steps: int = 1
    max_norm: float = 1.0  # gradient clipping; 0 disables (the norm is still computed and logged)
    steps: int = 100
    seed: int = 0
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    flow_shift: float = 1.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    caption_dropout: float = 0.1
    ema_decay: float = 0.0  # 0 disables EMA
    max_consecutive_nonfinite: int = 10


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1  # -1: world size / replicate degree
    data_parallel_replicate_degree: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_every: int = 2


@dataclass
class Compile:
    enable: bool = False


@dataclass
class Checkpoint:
    enable: bool = True
    folder: str = "checkpoint"  # under dump_folder
    interval: int = 500
    keep_latest_k: int = 3  # 0 keeps all
    async_mode: str = "disabled"  # disabled | async
    resume_from: str = "latest"  # latest | none | a step folder path
    initial_load_path: str = ""  # full-model file or DCP folder to start from (model only)


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    peak_flops: float = 0.0  # per device; 0: known GPU table on CUDA, none on CPU
    slow_data_warning: float = 0.2  # warn when waiting for data exceeds this share of a step


@dataclass
class Validation:
    enable: bool = True
    freq: int = 100
    at_start: bool = True
    # embedded as the data's captions are: keep them within data.caption_length tokens (bytes for tiny-t5)
    prompts: list = field(default_factory=lambda: ["digit zero", "the number 3", "a drawn seven", "handwritten 9"])
    images_per_prompt: int = 2
    sampling_steps: int = 20
    cfg_scale: float = 4.0
    seed: int = 0
    use_ema: bool = False
    loss_sigmas: list = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    num_loss_samples: int = 64
    vae: str = ""  # local path of a diffusers AutoencoderDC to decode latents; "" shows them directly


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    source: str = "<defaults>"  # the TOML file the values came from (for messages)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
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
    return json.dumps(value)  # numbers and double-quoted strings are valid TOML


CHOICES = {
    ("optimizer", "name"): ("adamw", "came"),
    ("lr_scheduler", "decay_type"): ("constant", "cosine", "linear"),
    # no float16: it needs a gradient scaler, and bfloat16 does the same job without one
    ("training", "mixed_precision_param"): ("float32", "bfloat16"),
    ("training", "mixed_precision_reduce"): ("float32", "bfloat16"),
    ("activation_checkpoint", "mode"): ("none", "full", "selective"),
    ("checkpoint", "async_mode"): ("disabled", "async"),
}
POSITIVE = {
    ("optimizer", "lr"),
    ("training", "local_batch_size"),
    ("training", "gradient_accumulation_steps"),
    ("training", "steps"),
    ("checkpoint", "interval"),
    ("metrics", "log_freq"),
    ("validation", "freq"),
    ("validation", "sampling_steps"),
    ("training", "max_consecutive_nonfinite"),
    ("data", "caption_length"),
    ("parallelism", "data_parallel_replicate_degree"),
    ("activation_checkpoint", "selective_every"),
    ("validation", "images_per_prompt"),
}
NON_NEGATIVE = {
    ("optimizer", "weight_decay"),
    ("training", "max_norm"),
    ("lr_scheduler", "warmup_steps"),
    ("checkpoint", "keep_latest_k"),
    ("training", "logit_std"),
    ("metrics", "peak_flops"),
    ("validation", "num_loss_samples"),
    ("training", "global_batch_size"),
}
UNIT_INTERVAL = {("training", "caption_dropout"), ("training", "ema_decay"), ("lr_scheduler", "min_lr_ratio")}


def _sections() -> dict[str, type]:
    return {f.name: f.type for f in dataclasses.fields(JobConfig) if f.name != "source"}


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(value: Any, expected: type, where: str) -> Any:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
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
        value = tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        value = raw  # a bare string
    return section, name, value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> JobConfig:
    """Read a TOML file (or defaults when None), apply overrides, validate everything."""
    source = str(path) if path else "<defaults>"
    raw: dict[str, dict] = {}
    if path:
        try:
            raw = tomli.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {source} does not exist") from None
        except tomli.TOMLDecodeError as exc:
            raise ConfigError(f"config file {source} is not valid TOML: {exc}") from None
    for text in overrides:
        section, name, value = _parse_override(text)
        raw.setdefault(section, {})[name] = value
    sections = _sections()
    config = JobConfig(source=source)
    for section, values in raw.items():
        if section not in sections:
            raise ConfigError(f"{source}: unknown section [{section}]; allowed: {', '.join(sections)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of keys")
        target = getattr(config, section)
        types_ = _field_types(type(target))
        for name, value in values.items():
            where = f"{source}: {section}.{name}"
            if section == "model" and name != "name":
                target.overrides[name] = value
                continue
            if name not in types_:
                raise ConfigError(f"{source}: unknown key {section}.{name}; allowed: {', '.join(types_)}")
            setattr(target, name, _coerce(value, types_[name], where))
    _validate_values(config)
    return config


def _validate_values(config: JobConfig) -> None:
    source = config.source
    for (section, name), allowed in CHOICES.items():
        value = getattr(getattr(config, section), name)
        if value not in allowed:
            raise ConfigError(f"{source}: {section}.{name} = {value!r} is not allowed; choose one of {allowed}")
    for section, name in POSITIVE:
        if getattr(getattr(config, section), name) <= 0:
            raise ConfigError(f"{source}: {section}.{name} must be > 0")
    for section, name in NON_NEGATIVE:
        if getattr(getattr(config, section), name) < 0:
            raise ConfigError(f"{source}: {section}.{name} must be >= 0")
    for section, name in UNIT_INTERVAL:
        value = getattr(getattr(config, section), name)
        closed = name == "min_lr_ratio"  # a ratio of 1 (no decay) is fine; a dropout or decay of 1 is not
        if not (0 <= value <= 1 if closed else 0 <= value < 1):
            raise ConfigError(f"{source}: {section}.{name} = {value} must be in [0, 1{']' if closed else ')'}")
    sched = config.lr_scheduler
    if sched.decay_type != "constant" and config.training.steps <= sched.warmup_steps:
        raise ConfigError(
            f"{source}: training.steps = {config.training.steps} must exceed "
            f"lr_scheduler.warmup_steps = {sched.warmup_steps} for {sched.decay_type} decay"
        )
    _check_lists(config)
    if config.training.flow_shift <= 0:
        raise ConfigError(f"{source}: training.flow_shift must be > 0")
    if config.optimizer.name == "adamw" and (len(config.optimizer.betas) != 2 or len(config.optimizer.eps) != 1):
        raise ConfigError(f"{source}: optimizer.betas must have 2 values and optimizer.eps 1 value for adamw")
    if config.optimizer.name == "came" and (len(config.optimizer.betas) != 3 or len(config.optimizer.eps) != 2):
        raise ConfigError(f"{source}: optimizer.betas must have 3 values and optimizer.eps 2 values for came")
    from sana2.models import ModelConfigError, model_keywords

    try:
        model_keywords(config.model.name, config.model.overrides)
    except ModelConfigError as exc:
        raise ConfigError(f"{source}: [model] {exc}") from None


def _check_lists(config: JobConfig) -> None:
    """The list fields: element types and ranges."""
    source = config.source
    numbers = {
        "optimizer.betas": config.optimizer.betas,
        "optimizer.eps": config.optimizer.eps,
        "validation.loss_sigmas": config.validation.loss_sigmas,
    }
    for key, values in numbers.items():
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{source}: {key} must be a list of numbers, got {values!r}")
    if not all(0 <= b < 1 for b in config.optimizer.betas):
        raise ConfigError(f"{source}: optimizer.betas must each be in [0, 1), got {config.optimizer.betas}")
    if not all(e > 0 for e in config.optimizer.eps):
        raise ConfigError(f"{source}: optimizer.eps must each be > 0, got {config.optimizer.eps}")
    if not all(0 <= s <= 1 for s in config.validation.loss_sigmas):
        raise ConfigError(
            f"{source}: validation.loss_sigmas must each be in [0, 1], got {config.validation.loss_sigmas}"
        )
    prompts = config.validation.prompts
    if config.validation.enable and (not prompts or not all(isinstance(p, str) for p in prompts)):
        raise ConfigError(f"{source}: validation.prompts must be a non-empty list of strings, got {prompts!r}")


def validate_world(config: JobConfig, world_size: int) -> tuple[int, int]:
    """Resolve the data-parallel degrees against the world size; returns (replicate, shard)."""
    p = config.parallelism
    replicate = p.data_parallel_replicate_degree
    shard = p.data_parallel_shard_degree
    if shard == -1:
        if world_size % replicate:
            raise ConfigError(
                f"{config.source}: parallelism.data_parallel_replicate_degree = {replicate} does "
                f"not divide the world size {world_size}"
            )
        shard = world_size // replicate
    if shard <= 0 or replicate * shard != world_size:
        raise ConfigError(
            f"{config.source}: parallelism.data_parallel_replicate_degree x "
            f"data_parallel_shard_degree = {replicate} x {shard} must equal the world size {world_size}"
        )
    t = config.training
    if t.global_batch_size:
        per_step = world_size * t.gradient_accumulation_steps
        if t.global_batch_size % per_step:
            raise ConfigError(
                f"{config.source}: training.global_batch_size = {t.global_batch_size} is not divisible "
                f"by world size x gradient_accumulation_steps = {per_step}"
            )
        t.local_batch_size = t.global_batch_size // per_step
    return replicate, shard


def main_config(argv: list[str] | None = None) -> JobConfig:
    """`--job.config_file=PATH` (or the first positional argument) plus overrides."""
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
    return load_config(path, rest)


def check_main(argv: list[str] | None = None) -> int:
    """`python -m sana2.config --world-size N CONFIG [overrides]`: validate before launching.

    run_train.sh calls this first, so a bad config stops with one message instead of a torchrun
    failure report from every worker.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    try:
        validate_world(main_config(argv), world_size)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(check_main())
