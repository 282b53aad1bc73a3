"""Typed model configs, one per model family: the [model] section of a run config, checked beside its fields.

`SanaConfig` builds the image DiT (SanaMS), `SanaVideoConfig` the video DiT (SanaMSVideo). Field names are
Sana's constructor keywords, so a Sana config, a parity fixture's `constructor_kwargs` and a diffusers folder
translate one to one; `from_keywords` also takes the keywords of Sana's that sana2 reads but does not need
(`SANA_ONLY`), and refuses variants it does not implement (`FIXED`). A leaf module: it imports nothing of sana2.
"""

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal


class ModelConfigError(ValueError):
    """A model name or keyword that sana2 cannot build; the message names it and what is allowed."""


@dataclass(frozen=True)
class SanaConfig:
    """The image DiT (SanaMS). Defaults are Sana's SanaMS_600M_P1_D28 at 512px."""

    input_size: int = 16
    """Latent side length the position embedding is laid out for (512px / DC-AE f32 = 16)."""
    patch_size: int | tuple[int, ...] = 1
    """Latent pixels per token side (an integer, or one per latent axis)."""
    in_channels: int = 32
    """Latent channels (DC-AE f32c32: 32)."""
    hidden_size: int = 1152
    """Token width; a multiple of num_heads (and of linear_head_dim for linear attention)."""
    depth: int = 28
    """Transformer blocks."""
    num_heads: int = 16
    """Heads of the cross-attention (and of softmax self-attention)."""
    mlp_ratio: float = 2.5
    """GLUMBConv hidden width / hidden_size."""
    pred_sigma: bool = False
    """Predict a variance too (twice the output channels); Sana's flow models do not."""
    caption_channels: int = 2304
    """Width of the text encoder's embeddings (Gemma-2-2B: 2304)."""
    model_max_length: int = 300
    """Caption tokens: the text encoder pads or cuts every caption to this many (Sana: 300) in prepare, online
    mode, validation and sampling; the data's captions must have this length. (Configs before it was the one
    setting set data.caption_length, still read as this.)"""
    pe_interpolation: float = 1.0
    """Scale of the sin-cos position grid (use_pe)."""
    use_pe: bool = False
    """Add a sin-cos absolute position embedding to the tokens."""
    attn_type: Literal["linear", "flash"] = "linear"
    """Self-attention: ReLU linear attention, or softmax ("flash", Sana's name for it)."""
    linear_head_dim: int = 32
    """Channels per head of linear attention."""
    qk_norm: bool = False
    """RMS-normalise queries and keys of self-attention."""
    cross_norm: bool = False
    """RMS-normalise queries and keys of cross-attention (Sana-1.5)."""
    cross_attn_type: Literal["flash", "linear", "vanilla"] = "flash"
    """Cross-attention kernel: all compute the same softmax attention; "vanilla" computes it in fp32."""
    y_norm: bool = True
    """RMS-normalise the projected caption tokens."""
    y_norm_scale_factor: float = 0.01
    """Initial scale of that norm (Sana's 0.01 tames Gemma's large activations)."""
    timestep_norm_scale_factor: float = 1.0
    """Timesteps are divided by this before their sinusoidal embedding."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_type(type(self).__name__, f.name, getattr(self, f.name), _field_type(type(self), f.name))
        if isinstance(self.patch_size, list):
            object.__setattr__(self, "patch_size", tuple(self.patch_size))
        positive = ("input_size", "in_channels", "hidden_size", "depth", "num_heads", "caption_channels")
        for name in (*positive, "model_max_length", "linear_head_dim", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"model keyword {name}={getattr(self, name)!r}: expected a value > 0")
        patches = self.patch_size if isinstance(self.patch_size, tuple) else (self.patch_size,)
        if any(p <= 0 for p in patches):
            raise ModelConfigError(f"model keyword patch_size={self.patch_size!r}: expected values > 0")
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}")
        if self.attn_type in ("linear", "LiteLAReLURope") and self.hidden_size % self.linear_head_dim:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} is not divisible by linear_head_dim={self.linear_head_dim}"
            )

    def keywords(self) -> dict[str, Any]:
        """Every field as the model class's constructor keyword."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class SanaVideoConfig(SanaConfig):
    """The video DiT (SanaMSVideo): the image DiT's fields plus the video ones. Defaults are Sana-Video 2B."""

    patch_size: int | tuple[int, ...] = (1, 2, 2)
    """Latent frames, rows and columns per token."""
    in_channels: int = 16
    """Latent channels (the Wan VAE: 16)."""
    hidden_size: int = 2240
    depth: int = 20
    num_heads: int = 20
    mlp_ratio: float = 3.0
    input_size: int = 60
    linear_head_dim: int = 112
    use_pe: bool = True
    """With pos_embed_type "wan_rope" and attn_type "LiteLAReLURope": rotary position embeddings."""
    qk_norm: bool = True
    cross_norm: bool = True
    attn_type: Literal["LiteLAReLURope", "linear"] = "LiteLAReLURope"
    """Self-attention: linear attention with 3-D rotary embeddings, or plain linear attention."""
    ffn_type: Literal["GLUMBConvTemp", "glumbconv"] = "GLUMBConvTemp"
    """GLUMBConv with a temporal convolution added, or without."""
    pos_embed_type: Literal["wan_rope"] = "wan_rope"
    """The rotary embedding's layout (Wan's split of the head over frames, rows and columns)."""
    t_kernel_size: int = 3
    """Frames the temporal convolution spans."""

    def __post_init__(self):
        super().__post_init__()
        if self.t_kernel_size <= 0 or self.t_kernel_size % 2 == 0:
            raise ModelConfigError(f"model keyword t_kernel_size={self.t_kernel_size}: expected an odd number > 0")


# Keywords of Sana's that sana2 reads and needs nowhere else: accepted, ignored.
SANA_ONLY = {
    "config": "Sana's logging",
    "null_embed_path": "Sana's file loading",
    # sana2 drops captions in one place, training.caption_dropout (sana2/components/flow.py)
    "class_dropout_prob": "training.caption_dropout",
}

# Keywords that select a variant sana2 does not implement: only the released value is accepted.
FIXED = {
    "micro_condition": (False,),
    "discrete_norm_timestep": (False,),
    "mlp_acts": (("silu", "silu", None),),
    "rope_fhw_dim": (None,),
    "cross_attn_image_embeds": (False,),
    "flash_attn_window_count": (None,),
    "pack_latents": (False,),
}

# keywords of Sana's image model that have one value in sana2: accepted at that value
IMAGE_FIXED = {"ffn_type": ("glumbconv",), "pos_embed_type": ("sincos",)}


def from_keywords(config_class: type[SanaConfig], preset: dict[str, Any], keywords: dict[str, Any], where: str):
    """A `config_class` from a preset and Sana's constructor keywords (aliases, Sana-only and fixed ones)."""
    values = dict(preset)
    for key, value in keywords.items():
        value = tuple(value) if isinstance(value, list) else value
        if key in SANA_ONLY:
            continue
        if key == "learn_sigma":  # Sana's alias of pred_sigma
            if value != keywords.get("pred_sigma", value):
                raise ModelConfigError(f"model keyword learn_sigma={value!r} contradicts pred_sigma")
            values["pred_sigma"] = value
            continue
        fixed = FIXED.get(key) or (IMAGE_FIXED.get(key) if config_class is SanaConfig else None)
        if fixed is not None:
            if value not in fixed:
                raise ModelConfigError(f"model keyword {key}={value!r} is not supported; allowed: {fixed}")
            continue
        values[key] = value
    names = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ModelConfigError(f"unknown keyword(s) for {where} ({config_class.__name__}): {', '.join(unknown)}")
    for key, value in values.items():
        _check_type(where, key, value, _field_type(config_class, key))
    try:
        return config_class(**values)
    except ModelConfigError as exc:
        raise ModelConfigError(f"{where}: {exc}") from None


def _field_type(config_class: type, name: str):
    return typing.get_type_hints(config_class)[name]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(where: str, key: str, value, expected) -> None:
    """A keyword takes its field's type: the string "False" where a flag belongs is truthy, and would build
    another model without a word."""
    if typing.get_origin(expected) is Literal:
        allowed = typing.get_args(expected)
        if value not in allowed:
            raise ModelConfigError(f"model keyword {key}={value!r} is not supported; allowed: {allowed}")
        return
    if key == "patch_size":
        fits = _is_int(value) or (isinstance(value, (tuple, list)) and all(_is_int(v) for v in value))
        wanted = "an integer or a list of integers"
    elif expected is bool:
        fits, wanted = isinstance(value, bool), "true or false"
    elif expected is int:
        fits, wanted = _is_int(value), "an integer"
    elif expected is float:
        fits, wanted = _is_int(value) or isinstance(value, float), "a number"
    else:
        fits, wanted = isinstance(value, expected), expected.__name__
    if not fits:
        raise ModelConfigError(f"model keyword {key}={value!r} for {where}: expected {wanted}")
