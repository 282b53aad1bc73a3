"""Model registry: the reference's names, its constructor keywords, and strict validation."""

import inspect
from typing import Any

from torch import nn

from sana2.models.sana import SanaMS
from sana2.models.sana_video import SanaMSVideo


class ModelConfigError(ValueError):
    """A model name or constructor keyword that sana2 cannot build."""


# Keywords the reference accepts that only steer its logging or file loading: accepted, ignored.
IGNORED_KWARGS = {"config", "null_embed_path"}

# Keywords that select a variant sana2 does not implement: only the released value is accepted.
FIXED_KWARGS = {
    "micro_condition": (False,),
    "discrete_norm_timestep": (False,),
    "mlp_acts": (("silu", "silu", None),),
    "rope_fhw_dim": (None,),
    "cross_attn_image_embeds": (False,),
    "flash_attn_window_count": (None,),
    "pack_latents": (False,),
}

CHOICES = {
    SanaMS: {
        "attn_type": ("linear", "flash"),
        "ffn_type": ("glumbconv",),
        "cross_attn_type": ("flash", "linear", "vanilla"),
        "pos_embed_type": ("sincos",),
    },
    SanaMSVideo: {
        "attn_type": ("LiteLAReLURope", "linear"),
        "ffn_type": ("GLUMBConvTemp", "glumbconv"),
        "cross_attn_type": ("flash", "linear", "vanilla"),
        "pos_embed_type": ("wan_rope",),
    },
}

# name -> (class, preset keywords). The class names take every keyword explicitly.
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
        ),
    ),
}


def _normalise(value):
    return tuple(value) if isinstance(value, list) else value


def model_keywords(name: str, overrides: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """Validate `overrides` for model `name`; return the class and the keywords it is built with."""
    if name not in MODELS:
        raise ModelConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    cls, preset = MODELS[name]
    kwargs = dict(preset)
    for key, value in overrides.items():
        value = _normalise(value)
        if key in IGNORED_KWARGS:
            continue
        if key == "learn_sigma":  # the reference's alias of pred_sigma
            if value != overrides.get("pred_sigma", value):
                raise ModelConfigError(f"model keyword learn_sigma={value!r} contradicts pred_sigma")
            continue
        if key in FIXED_KWARGS:
            if value not in FIXED_KWARGS[key]:
                raise ModelConfigError(f"model keyword {key}={value!r} is not supported; allowed: {FIXED_KWARGS[key]}")
            continue
        choices = CHOICES[cls].get(key)
        if choices is not None and value not in choices:
            raise ModelConfigError(f"model keyword {key}={value!r} is not supported; allowed: {choices}")
        if key in ("ffn_type", "pos_embed_type") and cls is SanaMS:
            continue  # the image model has one FFN and one positional embedding
        kwargs[key] = value
    unknown = sorted(set(kwargs) - set(_constructor_defaults(cls)))
    if unknown:
        raise ModelConfigError(f"unknown keyword(s) for {name} ({cls.__name__}): {', '.join(unknown)}")
    _check_shapes(name, kwargs, cls)
    return cls, kwargs


def constructor_keywords(name: str, overrides: dict[str, Any] | None = None) -> tuple[type, dict[str, Any]]:
    """The class and every constructor keyword, defaults included, that build_model(name, **overrides) uses."""
    cls, kwargs = model_keywords(name, overrides or {})
    return cls, {**_constructor_defaults(cls), **kwargs}


def _constructor_defaults(cls: type) -> dict[str, Any]:
    """Every keyword the class (and its model base classes) accepts, with its default."""
    defaults = {}
    for klass in reversed(cls.__mro__[: cls.__mro__.index(nn.Module)]):
        for n, p in inspect.signature(klass.__init__).parameters.items():
            if p.kind is inspect.Parameter.KEYWORD_ONLY:
                defaults[n] = p.default
    return defaults


def _check_shapes(name: str, kwargs: dict[str, Any], cls: type) -> None:
    merged = {**_constructor_defaults(cls), **kwargs}
    hidden = merged["hidden_size"]
    heads = merged["num_heads"]
    if hidden % heads:
        raise ModelConfigError(f"{name}: hidden_size={hidden} is not divisible by num_heads={heads}")
    attention = merged.get("attn_type")
    if attention in ("linear", "LiteLAReLURope") and hidden % merged["linear_head_dim"]:
        raise ModelConfigError(
            f"{name}: hidden_size={hidden} is not divisible by linear_head_dim={merged['linear_head_dim']}"
        )


def build_model(name: str, **overrides) -> nn.Module:
    """Build a registered model (on the current default device: use torch.device('meta') to allocate nothing).

    Registry names take the reference's constructor keywords as overrides, so
    `build_model(fixture["model_class"], **fixture["constructor_kwargs"])` rebuilds a fixture.
    """
    cls, kwargs = model_keywords(name, overrides)
    return cls(**kwargs)
