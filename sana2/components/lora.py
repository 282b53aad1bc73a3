"""LoRA fine-tuning through peft, the "lora" model transform (`[model_transforms] names = ["lora"]`, set up by
[lora]; sana2/components/model_transforms.py), run on the meta model between building it and parallelising
it, so FSDP2 shards the adapters with their blocks.

peft's `inject_adapter_in_model` wraps each target `nn.Linear` as a LoRA layer: the original becomes
`<target>.base_layer` and the adapter adds `<target>.lora_A.default` [rank, in] and `.lora_B.default`
[out, rank], scaled by alpha / rank. Everything but the adapters is frozen and held in the compute dtype
(training.mixed_precision_param): only the adapters are in the optimizer, the EMA and the checkpoint
(ModelState skips frozen parameters), whose base is `checkpoint.initial_load_path`, loaded again on resume.

Targets (`[lora] target_modules`) are sana2's module names, matched as name suffixes; diffusers' names are
accepted too. The defaults are diffusers' Sana LoRA script's, to_q, to_k and to_v of both attentions, which
in Sana's layout are three fused layers: `attn.qkv` (self-attention q, k, v), `cross_attn.q_linear` and
`cross_attn.kv_linear` (cross-attention k, v). A fused layer's adapter has one A shared by its parts: it is
diffusers' adapters on to_q, to_k, to_v with equal A and B split by rows, which is how it is exported.

The adapters' initial values follow peft's "gaussian" init (A ~ N(0, 1/rank^2) as peft draws it, B = 0, so
the model starts as its base), drawn by sana2's name-seeded initialisation so that every world size starts
from the same adapters.
"""

import re
from pathlib import Path

import torch
from torch import nn

from sana2.components.model_transforms import register_transform
from sana2.config import LORA_TARGETS
from sana2.formats.tensors import CheckpointError

NULL_CAPTION = "y_embedder.y_embedding"  # the run's null caption, a buffer its checkpoint carries

ADAPTER = "default"  # peft's adapter name in parameter names: <target>.lora_A.default.weight
# diffusers' names of Sana's linear layers -> sana2's (a fused layer stands for each of its parts)
DIFFUSERS_NAMES = {
    "to_q": ("attn.qkv", "cross_attn.q_linear"),
    "to_k": ("attn.qkv", "cross_attn.kv_linear"),
    "to_v": ("attn.qkv", "cross_attn.kv_linear"),
    "attn1.to_q": ("attn.qkv",),
    "attn1.to_k": ("attn.qkv",),
    "attn1.to_v": ("attn.qkv",),
    "attn2.to_q": ("cross_attn.q_linear",),
    "attn2.to_k": ("cross_attn.kv_linear",),
    "attn2.to_v": ("cross_attn.kv_linear",),
    "to_out.0": ("attn.proj", "cross_attn.proj"),
    "attn1.to_out.0": ("attn.proj",),
    "attn2.to_out.0": ("cross_attn.proj",),
}
_ADAPTER_NAME = re.compile(rf"\.lora_[AB]\.{ADAPTER}\.")


def sana2_targets(names: list[str]) -> list[str]:
    """sana2 module-name suffixes for `names` (sana2's or diffusers'), in order, each once."""
    targets = []
    for name in names:
        for target in DIFFUSERS_NAMES.get(name, (name,)):
            if target not in targets:
                targets.append(target)
    return targets


def is_adapter(name: str) -> bool:
    return _ADAPTER_NAME.search(name) is not None


def base_name(name: str) -> str:
    """The plain model's name of a parameter of the LoRA model (`...qkv.base_layer.weight` -> `...qkv.weight`)."""
    return name.replace(".base_layer.", ".")


def enabled(config) -> bool:
    """Whether the run trains LoRA adapters: "lora" in [model_transforms] names."""
    return "lora" in config.model_transforms.names


class LoRA:
    """The "lora" model transform, from the [lora] section."""

    def __init__(self, config):
        self.config = config

    def apply(self, model: nn.Module) -> nn.Module:
        return add_adapters(model, self.config)


@register_transform("lora")
def _lora(config) -> LoRA:
    return LoRA(config)


def add_adapters(model: nn.Module, config) -> nn.Module:
    """Add `config.lora`'s adapters to `model` (on meta), freeze the rest in the compute dtype; returns it."""
    lora = config.lora
    from peft import LoraConfig, inject_adapter_in_model

    targets = sana2_targets(list(lora.target_modules))
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if unmatched:
        raise config.error(
            f"lora.target_modules: {', '.join(unmatched)} match no linear layer of {config.model.name} "
            f"(e.g. {', '.join(LORA_TARGETS)}, or diffusers' to_q, to_k, to_v, to_out.0)"
        )
    peft_config = LoraConfig(
        r=lora.rank, lora_alpha=lora_alpha(lora), lora_dropout=lora.dropout, target_modules=targets, bias="none"
    )
    device = next(model.parameters()).device
    with torch.device(device):
        inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER)
    compute = getattr(torch, config.training.mixed_precision_param)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
        if not is_adapter(name):
            param.data = param.data.to(compute)  # the frozen base: stored, gathered and used in the compute dtype
    plain_initial_value = model.initial_value

    def initial_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        if f".lora_B.{ADAPTER}." in name:
            return torch.zeros(shape)
        if f".lora_A.{ADAPTER}." in name:
            return torch.randn(shape, generator=generator) / lora.rank  # peft's "gaussian": std 1 / rank
        return plain_initial_value(name, shape, generator)  # a wrapped layer: its base_layer, a plain Linear

    model.initial_value = initial_value
    return model


def adapter_parameters(model: nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if is_adapter(name))


def lora_alpha(lora) -> float:
    """[lora] alpha, 0 standing for the rank (scale 1, as diffusers' Sana script)."""
    return lora.alpha or float(lora.rank)


def scaling(lora) -> float:
    """peft's scale of B A: alpha / rank."""
    return lora_alpha(lora) / lora.rank


def merged_state(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The plain model's state of a LoRA model's full `state`: each wrapped weight W + scale B A (computed in
    float32, kept in W's dtype) under its plain name, the adapters gone."""
    merged = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        layer, _, leaf = name.rpartition(".base_layer.")
        if layer and leaf == "weight":
            lora_a, lora_b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            tensor = (tensor.float() + scale * (lora_b.float() @ lora_a.float())).to(tensor.dtype)
        merged[base_name(name)] = tensor
    return merged


def load_adapters(model: nn.Module, folder: Path, ema: bool = False) -> list[str]:
    """Load a LoRA run's DCP step folder into `model` (its base already loaded): the adapters (the EMA's with
    `ema`) and the null caption; returns the optional keys it did not hold, as load_initial_weights does."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from sana2.formats.dcp_folder import load_verified, read_checked_metadata, read_marker, stored_shapes

    stored = stored_shapes(read_checked_metadata(folder, require_complete=False))
    state = get_model_state_dict(model)
    adapters = {name: tensor for name, tensor in state.items() if is_adapter(name)}
    source = "ema" if ema else "model"
    missing = [name for name in adapters if f"{source}.{name}" not in stored]
    if missing:
        where = "EMA weights (the run had training.ema_decay = 0)" if ema else "adapters"
        raise CheckpointError(f"{folder} holds no {where}: it lacks {', '.join(missing[:3])}")
    template = {source: adapters}
    kept = [NULL_CAPTION] if f"model.{NULL_CAPTION}" not in stored else []
    if not kept:
        template.setdefault("model", {})[NULL_CAPTION] = state[NULL_CAPTION]
    load_verified(folder, template, require_checksums=bool(read_marker(folder).get("checksums")))
    loaded = {**adapters, **({} if kept else {NULL_CAPTION: state[NULL_CAPTION]})}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    return kept
