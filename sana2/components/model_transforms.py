"""Model transforms: what changes the model between its build on `meta` and its parallelisation.

A transform (torchtitan calls them model converters: float8, LoRA) replaces modules, adds parameters or
freezes some (requires_grad False). The config lists them, `[model_transforms] names = [...]`, and the
trainer applies them in that order:

    with torch.device("meta"):
        model = build_model(...)
    model = apply_transforms(model, build_transforms(config))    # here
    parallelize_sana(model, dims, ...)                            # AC, compile, FSDP2
    materialize(...); init_weights(...)                           # every parameter, frozen ones too

A new transform is a class with `apply(model) -> model`, registered under its name with a factory that
builds it from the JobConfig (its own keys live in [model_transforms] or a section of its own):

    @register_transform("lora")
    def _lora(config) -> ModelTransform: ...

What trains is what the transforms left with requires_grad: the optimizer steps `trainable_parameters`,
EMA averages them, and the checkpoint saves them (frozen parameters come back from
checkpoint.initial_load_path, or from the seeded initialisation, on every start, resumes included).
"""

import fnmatch
import importlib
from collections.abc import Callable
from typing import Protocol

from torch import nn


class ModelTransform(Protocol):
    def apply(self, model: nn.Module) -> nn.Module:
        """Change `model` (on meta, not yet parallelised) in place or return a new one."""


TRANSFORMS: dict[str, Callable[..., ModelTransform]] = {}
"""name -> factory(config) -> ModelTransform."""


def register_transform(name: str):
    def register(factory: Callable[..., ModelTransform]):
        if name in TRANSFORMS:
            raise ValueError(f"a model transform named {name!r} is registered already")
        TRANSFORMS[name] = factory
        return factory

    return register


# Modules whose import registers sana2's own transforms (they import this module, so not at its top). Every
# builder of a model (trainer, dry run, sampler, exporter) gets them through build_transforms, not by
# remembering to import them.
BUILTIN_TRANSFORM_MODULES = ("sana2.components.lora",)


def build_transforms(config) -> list[ModelTransform]:
    """The transforms config.model_transforms.names lists, built in order; an unknown name is a ConfigError."""
    for module in BUILTIN_TRANSFORM_MODULES:
        importlib.import_module(module)
    transforms = []
    for name in config.model_transforms.names:
        if name not in TRANSFORMS:
            raise config.error(
                f"model_transforms.names: unknown transform {name!r}; registered: {', '.join(sorted(TRANSFORMS))}"
            )
        transforms.append(TRANSFORMS[name](config))
    return transforms


def apply_transforms(model: nn.Module, transforms: list[ModelTransform]) -> nn.Module:
    for transform in transforms:
        model = transform.apply(model)
    return model


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> parameter of what trains: the optimizer's, EMA's and the checkpoint's parameters."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


def frozen_parameter_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if not param.requires_grad]


class Freeze:
    """Parameters whose names match one of `patterns` (fnmatch) do not train."""

    def __init__(self, patterns: list[str]):
        self.patterns = list(patterns)

    def apply(self, model: nn.Module) -> nn.Module:
        names = [name for name, _ in model.named_parameters()]
        for pattern in self.patterns:
            if not fnmatch.filter(names, pattern):
                raise ValueError(f"model_transforms.freeze: {pattern!r} matches no parameter of the model")
        for name, param in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns):
                param.requires_grad_(False)
        if not any(param.requires_grad for param in model.parameters()):
            raise ValueError(f"model_transforms.freeze = {self.patterns}: every parameter is frozen; nothing trains")
        return model


@register_transform("freeze")
def _freeze(config) -> Freeze:
    if not config.model_transforms.freeze:
        raise config.error('model_transforms.names lists "freeze" but model_transforms.freeze names no parameter')
    return Freeze(config.model_transforms.freeze)
