"""Model registry: names -> a model family (its class and typed config, sana2/models/config.py) and a preset."""

from typing import Any

from torch import nn

from sana2.models.config import ModelConfigError, SanaConfig, SanaVideoConfig, from_keywords
from sana2.models.sana import SanaMS
from sana2.models.sana_video import SanaMSVideo

__all__ = ["MODELS", "ModelConfigError", "build_model", "constructor_keywords", "model_config"]

# model class -> its config class
CONFIGS: dict[type, type[SanaConfig]] = {SanaMS: SanaConfig, SanaMSVideo: SanaVideoConfig}

# name -> (model class, preset keywords). The class names start from their config's defaults.
MODELS: dict[str, tuple[type, dict[str, Any]]] = {
    "SanaMS": (SanaMS, {}),
    "SanaMSVideo": (SanaMSVideo, {}),
    "SanaMS_600M_P1_D28": (SanaMS, dict(depth=28, hidden_size=1152, patch_size=1, num_heads=16)),
    "SanaMS_1600M_P1_D20": (SanaMS, dict(depth=20, hidden_size=2240, patch_size=1, num_heads=20)),
    "SanaMS_1600M_P1_D20_sana1.5": (
        SanaMS,
        dict(depth=20, hidden_size=2240, patch_size=1, num_heads=20, qk_norm=True, cross_norm=True, input_size=32),
    ),
    "SanaMSVideo_2000M_P2_D20": (SanaMSVideo, dict(depth=20, hidden_size=2240, patch_size=(1, 2, 2), num_heads=20)),
    # Small sizes for tests and the default CPU run.
    "SanaMS_debug": (
        SanaMS,
        dict(
            depth=2, hidden_size=64, num_heads=2, in_channels=4, caption_channels=32, model_max_length=16, input_size=8
        ),
    ),
    "SanaMS_digits": (
        SanaMS,
        dict(
            depth=4,
            hidden_size=128,
            num_heads=4,
            in_channels=1,
            patch_size=1,
            caption_channels=64,
            model_max_length=16,
            input_size=8,
            # 8x8 pixels: absolute positions tell a digit's strokes apart, and the tiny T5's caption
            # tokens are already of unit scale (Sana's 0.01 tames Gemma's large activations): at 0.01
            # the captions barely steer the first hundreds of steps and the default run draws blurs
            use_pe=True,
            y_norm_scale_factor=1.0,
        ),
    ),
}


def model_config(name: str, overrides: dict[str, Any] | None = None) -> SanaConfig:
    """The typed config of model `name` with `overrides` (Sana's keyword names): checked, or ModelConfigError."""
    if name not in MODELS:
        raise ModelConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    cls, preset = MODELS[name]
    return from_keywords(CONFIGS[cls], preset, overrides or {}, name)


def constructor_keywords(name: str, overrides: dict[str, Any] | None = None) -> tuple[type, dict[str, Any]]:
    """The class and every config field, defaults included, that build_model(name, **overrides) uses."""
    config = model_config(name, overrides)
    return MODELS[name][0], config.keywords()


def build_model(name: str, **overrides) -> nn.Module:
    """Build a registered model (on the current default device: use torch.device('meta') to allocate nothing).

    Registry names take Sana's constructor keywords as overrides, so
    `build_model(fixture["model_class"], **fixture["constructor_kwargs"])` rebuilds a fixture.
    """
    config = model_config(name, overrides)
    return MODELS[name][0](config)
