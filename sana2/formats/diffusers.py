"""sana2 <-> diffusers' Sana transformers: tensor names, per-tensor transforms, model configs.

diffusers holds Sana as `SanaTransformer2DModel` (image) and `SanaVideoTransformer3DModel`
(video). Their state dicts name the same weights differently and split three fused projections
along dim 0: the linear self-attention's `qkv` into `to_q`/`to_k`/`to_v`, and the
cross-attention's `kv_linear` into `to_k`/`to_v` (as diffusers' own Sana conversion scripts do).
Everything here works on names, shapes and one tensor at a time, so a streaming writer can
export or import a model of any size holding one tensor in memory:

- `export_pieces(name, video)`: the diffusers tensors one sana2 tensor becomes, each a dim-0
  chunk of it (`Piece.take`), with the chunk's shape known before the tensor is read
  (`Piece.shape`);
- `import_sources(names, video)`: for each sana2 tensor, the diffusers tensors whose dim-0
  concatenation (`join`) it is;
- `diffusers_config(model, overrides)` / `sana2_model(config)`: the model configs both ways.
  Every sana2 constructor option that changes what the forward computes is either carried over
  or refused with a `DiffusersFormatError` naming it.

Two sana2 tensors have no diffusers counterpart and are not exported: `pos_embed` (a buffer the
forward never reads) and `y_embedder.y_embedding` (the null caption used for classifier-free
dropout in training; diffusers' pipelines encode the empty prompt instead). An import has to fill
them from elsewhere (see `NOT_IN_DIFFUSERS`).
"""

import re
from typing import Any, NamedTuple

import torch

from sana2.models.registry import constructor_keywords
from sana2.models.sana_video import SanaMSVideo

# a diffusers model folder: config.json and one safetensors file, or numbered shards and an index
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
IMAGE_CLASS = "SanaTransformer2DModel"
VIDEO_CLASS = "SanaVideoTransformer3DModel"
# sana2 tensors diffusers does not hold, and where an import takes them from instead
NOT_IN_DIFFUSERS = {
    "pos_embed": "never read by the forward: the model's own initial value",
    "y_embedder.y_embedding": "the null caption for training's caption dropout: from the run (text encoder or init)",
}
# diffusers' fixed choices that sana2's models share (its constructor takes them as options)
NORM_EPS = 1e-6
QK_NORM = "rms_norm_across_heads"  # RMSNorm over all heads together, as Sana's q_norm / k_norm
VIDEO_TEMPORAL_KERNEL = 3  # diffusers' GLUMBTempConv has a fixed (3, 1) temporal conv
ROPE_MAX_SEQ_LEN = 1024


class DiffusersFormatError(ValueError):
    """A model option or tensor diffusers' Sana classes cannot hold; the message names it."""


class Piece(NamedTuple):
    """Diffusers tensor `name` is chunk `index` of `parts` equal dim-0 chunks of a sana2 tensor."""

    name: str
    index: int = 0
    parts: int = 1

    def shape(self, sana2_shape: tuple[int, ...]) -> tuple[int, ...]:
        rows = sana2_shape[0]
        if rows % self.parts:
            raise DiffusersFormatError(f"{self.name}: dim 0 of {tuple(sana2_shape)} does not split into {self.parts}")
        return (rows // self.parts, *sana2_shape[1:])

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This piece of the sana2 tensor: a view (contiguous when the tensor is)."""
        if self.parts == 1:
            return tensor
        return tensor.chunk(self.parts, dim=0)[self.index]


def _block(template: str, *targets: str) -> tuple[str, tuple[str, ...]]:
    return (rf"blocks\.(\d+)\.{template}", tuple(f"transformer_blocks.{{0}}.{t}" for t in targets))


# (sana2 name pattern, diffusers name templates filled with the pattern's groups); several
# templates: the sana2 tensor is their dim-0 concatenation, in this order.
_COMMON = (
    (r"t_embedder\.mlp\.0\.(weight|bias)", ("time_embed.emb.timestep_embedder.linear_1.{0}",)),
    (r"t_embedder\.mlp\.2\.(weight|bias)", ("time_embed.emb.timestep_embedder.linear_2.{0}",)),
    (r"t_block\.1\.(weight|bias)", ("time_embed.linear.{0}",)),
    (r"y_embedder\.y_proj\.fc1\.(weight|bias)", ("caption_projection.linear_1.{0}",)),
    (r"y_embedder\.y_proj\.fc2\.(weight|bias)", ("caption_projection.linear_2.{0}",)),
    (r"attention_y_norm\.weight", ("caption_norm.weight",)),
    _block(r"scale_shift_table", "scale_shift_table"),
    _block(r"attn\.qkv\.(weight|bias)", "attn1.to_q.{1}", "attn1.to_k.{1}", "attn1.to_v.{1}"),
    _block(r"attn\.q_norm\.weight", "attn1.norm_q.weight"),
    _block(r"attn\.k_norm\.weight", "attn1.norm_k.weight"),
    _block(r"attn\.proj\.(weight|bias)", "attn1.to_out.0.{1}"),
    _block(r"cross_attn\.q_linear\.(weight|bias)", "attn2.to_q.{1}"),
    _block(r"cross_attn\.kv_linear\.(weight|bias)", "attn2.to_k.{1}", "attn2.to_v.{1}"),
    _block(r"cross_attn\.q_norm\.weight", "attn2.norm_q.weight"),
    _block(r"cross_attn\.k_norm\.weight", "attn2.norm_k.weight"),
    _block(r"cross_attn\.proj\.(weight|bias)", "attn2.to_out.0.{1}"),
    _block(r"mlp\.inverted_conv\.conv\.(weight|bias)", "ff.conv_inverted.{1}"),
    _block(r"mlp\.depth_conv\.conv\.(weight|bias)", "ff.conv_depth.{1}"),
    _block(r"mlp\.point_conv\.conv\.weight", "ff.conv_point.weight"),
    (r"final_layer\.linear\.(weight|bias)", ("proj_out.{0}",)),
    (r"final_layer\.scale_shift_table", ("scale_shift_table",)),
)
_IMAGE = ((r"x_embedder\.proj\.(weight|bias)", ("patch_embed.proj.{0}",)),)
_VIDEO = (
    (r"x_embedder\.proj\.(weight|bias)", ("patch_embedding.{0}",)),
    _block(r"mlp\.t_conv\.weight", "ff.conv_temp.weight"),
)
_RULES = {
    video: [(re.compile(pattern), targets) for pattern, targets in _COMMON + (_VIDEO if video else _IMAGE)]
    for video in (False, True)
}


def export_pieces(name: str, video: bool) -> list[Piece]:
    """The diffusers tensors sana2 tensor `name` becomes ([] for the ones diffusers does not hold)."""
    if name in NOT_IN_DIFFUSERS:
        return []
    for pattern, targets in _RULES[video]:
        match = pattern.fullmatch(name)
        if match:
            groups = match.groups()
            return [Piece(t.format(*groups), i, len(targets)) for i, t in enumerate(targets)]
    kind = VIDEO_CLASS if video else IMAGE_CLASS
    raise DiffusersFormatError(f"sana2 tensor {name!r} has no counterpart in diffusers' {kind}")


# diffusers' LoRA file for a Sana pipeline: <prefix><module>.lora_A.weight [rank, in], .lora_B.weight [out, rank]
LORA_PREFIX = "transformer."


def lora_modules(layer: str, video: bool) -> list[Piece]:
    """The diffusers modules whose LoRA adapters stand for one on sana2 linear layer `layer`: those its
    weight becomes (export_pieces), by module name. A fused layer (attn.qkv, cross_attn.kv_linear) is
    several: each takes the same A and its own chunk of B's rows, so that B_i A is W_i's update."""
    pieces = export_pieces(f"{layer}.weight", video)
    return [piece._replace(name=piece.name.removesuffix(".weight")) for piece in pieces]


def import_sources(sana2_names, video: bool) -> dict[str, list[str]]:
    """sana2 name -> the diffusers names whose dim-0 concatenation it is, for every name diffusers holds."""
    sources = {}
    for name in sana2_names:
        pieces = export_pieces(name, video)
        if pieces:
            sources[name] = [piece.name for piece in pieces]
    return sources


def source_rows(names: list[str], rows: int, start: int, end: int) -> list[tuple[str, int, int]]:
    """Rows [start, end) of a sana2 tensor of `rows` rows joined from `names` (equal dim-0 pieces):
    (diffusers name, first row, end row) of each piece that holds some of them, in order. A sharded
    load reads only its own rows this way."""
    if rows % len(names) or not 0 <= start <= end <= rows:
        raise DiffusersFormatError(f"rows {start}:{end} of {rows} cannot be read from {len(names)} equal pieces")
    size = rows // len(names)
    ranges = []
    for index, name in enumerate(names):
        first, last = max(start - index * size, 0), min(end - index * size, size)
        if first < last:
            ranges.append((name, first, last))
    return ranges


def join(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sana2 tensor from its diffusers pieces, in `import_sources` order."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def check_diffusers_names(expected: set[str], found: set[str], where: str) -> None:
    """Raise one error naming every tensor a diffusers folder lacks or has beyond the model's."""
    problems = []
    for label, names in (("missing", sorted(expected - found)), ("unexpected", sorted(found - expected))):
        if names:
            more = f" (and {len(names) - 10} more)" if len(names) > 10 else ""
            problems.append(f"{label} {', '.join(names[:10])}{more}")
    if problems:
        raise DiffusersFormatError(f"{where} does not match the model: {'; '.join(problems)}")


# -- configs ---------------------------------------------------------------------------------------


def _refuse(option: str, value: Any, reason: str) -> DiffusersFormatError:
    return DiffusersFormatError(f"model option {option}={value!r} cannot be expressed in diffusers: {reason}")


def diffusers_config(model: str, overrides: dict | None = None) -> dict[str, Any]:
    """The diffusers config (config.json content) of sana2 model `model` built with `overrides`.

    Options that only steer training or initialisation (model_max_length,
    y_norm_scale_factor) have nothing to carry over. cross_attn_type "flash", "linear" and
    "vanilla" are the same softmax cross-attention ("vanilla" computes it in fp32 whatever the
    model's dtype; diffusers computes at the model's dtype).
    """
    cls, kw = constructor_keywords(model, overrides)
    video = issubclass(cls, SanaMSVideo)
    hidden, heads, head_dim = kw["hidden_size"], kw["num_heads"], kw["linear_head_dim"]
    if not kw["y_norm"]:
        raise _refuse("y_norm", False, "diffusers' Sana always RMS-normalises the caption tokens (caption_norm)")
    if kw["qk_norm"] != kw["cross_norm"]:
        reason = f"diffusers' Sana has one qk_norm for self- and cross-attention (cross_norm={kw['cross_norm']})"
        raise _refuse("qk_norm", kw["qk_norm"], reason)
    config: dict[str, Any] = {
        "in_channels": kw["in_channels"],
        "out_channels": kw["in_channels"] * (2 if kw["pred_sigma"] else 1),
        "num_attention_heads": hidden // head_dim,
        "attention_head_dim": head_dim,
        "num_layers": kw["depth"],
        "num_cross_attention_heads": heads,
        "cross_attention_head_dim": hidden // heads,
        "cross_attention_dim": hidden,
        "caption_channels": kw["caption_channels"],
        "mlp_ratio": kw["mlp_ratio"],
        "dropout": 0.0,
        "attention_bias": False,
        "sample_size": kw["input_size"],
        "norm_elementwise_affine": False,
        "norm_eps": NORM_EPS,
        "guidance_embeds": False,
        "qk_norm": QK_NORM if kw["qk_norm"] else None,
    }
    if video:
        config.update(_video_options(kw))
    else:
        config.update(_image_options(kw))
    return config


def _image_options(kw: dict) -> dict[str, Any]:
    if kw["attn_type"] != "linear":
        raise _refuse("attn_type", kw["attn_type"], f"{IMAGE_CLASS} has linear self-attention only")
    patch = tuple(kw["patch_size"]) if isinstance(kw["patch_size"], (list, tuple)) else (kw["patch_size"],) * 2
    if patch[0] != patch[1]:
        raise _refuse("patch_size", kw["patch_size"], f"{IMAGE_CLASS} takes square patches only")
    scale = kw["timestep_norm_scale_factor"]
    return {
        "_class_name": IMAGE_CLASS,
        "patch_size": patch[0],
        # diffusers' PatchEmbed adds the same sincos table (base grid input_size / patch) when this is set
        "interpolation_scale": kw["pe_interpolation"] if kw["use_pe"] else None,
        # sana2 divides t by the factor inside the model; SanaPipeline multiplies t by timestep_scale before it
        "timestep_scale": 1.0 if scale == 1 else 1.0 / scale,
    }


def _video_options(kw: dict) -> dict[str, Any]:
    if kw["attn_type"] != "LiteLAReLURope" or not kw["use_pe"] or kw["pos_embed_type"] != "wan_rope":
        option = next(
            (k, kw[k])
            for k, ok in (("attn_type", "LiteLAReLURope"), ("use_pe", True), ("pos_embed_type", "wan_rope"))
            if kw[k] != ok
        )
        raise _refuse(*option, f"{VIDEO_CLASS} always applies the 3-D rotary embedding in linear attention")
    if kw["ffn_type"] != "GLUMBConvTemp":
        raise _refuse("ffn_type", kw["ffn_type"], f"{VIDEO_CLASS} always has the temporal convolution")
    if kw["t_kernel_size"] != VIDEO_TEMPORAL_KERNEL:
        raise _refuse("t_kernel_size", kw["t_kernel_size"], f"{VIDEO_CLASS}'s temporal kernel is fixed at 3")
    if kw["timestep_norm_scale_factor"] != 1:
        factor = kw["timestep_norm_scale_factor"]
        raise _refuse("timestep_norm_scale_factor", factor, f"{VIDEO_CLASS} has no timestep scale")
    return {"_class_name": VIDEO_CLASS, "patch_size": list(kw["patch_size"]), "rope_max_seq_len": ROPE_MAX_SEQ_LEN}


def sana2_model(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The sana2 registry name and constructor keywords of a diffusers Sana config (config.json).

    The null-caption length (model_max_length) is not in a diffusers config: it comes from the run.
    A key missing or of the wrong type is a DiffusersFormatError naming it.
    """
    try:
        return _sana2_model(config)
    except KeyError as exc:
        raise DiffusersFormatError(
            f"{config.get('_class_name')} config has no {exc.args[0]!r} (diffusers writes every constructor argument)"
        ) from None
    except (TypeError, ValueError) as exc:
        kind = config.get("_class_name")
        raise DiffusersFormatError(f"{kind} config holds a value of the wrong type: {exc}") from None


def _sana2_model(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    kind = config.get("_class_name")
    if kind not in (IMAGE_CLASS, VIDEO_CLASS):
        raise DiffusersFormatError(f"config _class_name {kind!r}: sana2 reads {IMAGE_CLASS} and {VIDEO_CLASS}")
    video = kind == VIDEO_CLASS
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    hidden = heads * head_dim
    fixed = {
        "guidance_embeds": False,
        "norm_elementwise_affine": False,
        "norm_eps": NORM_EPS,
        "attention_bias": False,
        "dropout": 0.0,
        "cross_attention_dim": hidden,
    }
    for key, value in fixed.items():
        if config.get(key, value) != value:
            raise DiffusersFormatError(f"{kind} config {key}={config[key]!r}: sana2's Sana has {key}={value!r}")
    cross_heads = config["num_cross_attention_heads"]
    if cross_heads * config["cross_attention_head_dim"] != hidden:
        raise DiffusersFormatError(
            f"{kind} config: cross-attention {cross_heads} x {config['cross_attention_head_dim']} "
            f"channels differ from the model's {hidden}"
        )
    qk_norm = config.get("qk_norm")
    if qk_norm not in (None, QK_NORM):
        raise DiffusersFormatError(f"{kind} config qk_norm={qk_norm!r}: sana2 has None or {QK_NORM!r}")
    in_channels = config["in_channels"]
    out_channels = config.get("out_channels") or in_channels
    if out_channels not in (in_channels, 2 * in_channels):
        raise DiffusersFormatError(f"{kind} config out_channels={out_channels}: sana2 has in_channels or twice it")
    kwargs = {
        "in_channels": in_channels,
        "pred_sigma": out_channels == 2 * in_channels,
        "hidden_size": hidden,
        "depth": config["num_layers"],
        "num_heads": cross_heads,
        "linear_head_dim": head_dim,
        "mlp_ratio": config["mlp_ratio"],
        "caption_channels": config["caption_channels"],
        "input_size": config["sample_size"],
        "qk_norm": qk_norm is not None,
        "cross_norm": qk_norm is not None,
        "y_norm": True,
    }
    if video:
        kwargs.update(
            patch_size=tuple(config["patch_size"]),
            attn_type="LiteLAReLURope",
            ffn_type="GLUMBConvTemp",
            use_pe=True,
            pos_embed_type="wan_rope",
            t_kernel_size=VIDEO_TEMPORAL_KERNEL,
        )
        return "SanaMSVideo", kwargs
    scale = config.get("interpolation_scale")
    timestep_scale = config.get("timestep_scale", 1.0)
    kwargs.update(
        patch_size=config["patch_size"],
        attn_type="linear",
        use_pe=scale is not None,
        pe_interpolation=1.0 if scale is None else scale,
        timestep_norm_scale_factor=1.0 if timestep_scale == 1 else 1.0 / timestep_scale,
    )
    return "SanaMS", kwargs
