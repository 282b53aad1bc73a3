"""Start a sharded model from a full-model checkpoint or a DCP folder. Model weights only; optimizer
and step start fresh.

Full-model checkpoints are read by sana2/formats/full_model.py, the reader `sana2-convert --to-dcp`
uses too: the reference's .pth, Accelerate's .bin (or its model/ folder), a plain or
DDP-prefixed state dict, a legacy torch file, a .safetensors file, or a safetensors folder
(model.safetensors, or an index and shards as `sana2-convert --format safetensors` writes).
Each rank reads only the rows of its own shards (a legacy non-zip torch file cannot be read in
parts and is read whole: that format forces it); DCP folders load through DCP's resharding reads,
each item checked against its CRC32 list where the folder has them. `pos_embed` is skipped
whether or not the source holds it (the forward never reads it; the reference's loaders drop it).
The null caption `y_embedder.y_embedding` is loaded where the source holds it; a diffusers folder
from elsewhere (Sana's released weights) has none, and the model keeps its own. Any other missing,
unexpected or mis-shaped key stops the load with one message naming them (the same report a resume
gives).
"""

import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sana2.components import lora
from sana2.formats.dcp_folder import load_verified, read_checked_metadata, read_marker, stored_shapes
from sana2.formats.full_model import is_full_checkpoint, read_full_checkpoint
from sana2.formats.tensors import CheckpointError, SourceTensor, check_shapes

IGNORED_KEYS = {"pos_embed"}  # never read by the forward; the reference's loaders drop it too
# a buffer never trained, which diffusers' format has no place for: kept from the model where absent
OPTIONAL_KEYS = {"y_embedder.y_embedding"}


def _read_local(tensor: torch.Tensor, source: SourceTensor, local: torch.Tensor) -> None:
    """Fill `local` with this rank's part of the full `source` tensor for `tensor` (its DTensor shard, else all).

    FSDP2 shards dim 0: the shard is a range of rows, read on its own; any other layout is cut
    from the whole tensor.
    """
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        source.read_into(local)
        return
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if all(o == 0 for o in offset[1:]) and tuple(local_shape[1:]) == tuple(tensor.shape[1:]):
        source.read_into(local, offset[0])
        return
    region = source.read()
    for dim, (start, size) in enumerate(zip(offset, local_shape)):
        region = region.narrow(dim, start, size)
    local.copy_(region.reshape(local.shape))


def load_initial_weights(model: nn.Module, path: str | Path, ema: bool = False) -> list[str]:
    """Fill `model` (sharded or not) from a full checkpoint or a DCP folder; every mismatch is reported by key.

    ema: take the parameters from a DCP training checkpoint's EMA weights (buffers from its model).
    Returns the keys of OPTIONAL_KEYS the source did not hold (the model keeps its own values).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    if not is_full_checkpoint(path):
        return _load_dcp_model(model, path, ema)
    if ema:
        raise CheckpointError(f"{path} holds one set of weights: EMA weights come from a DCP training checkpoint")
    source = {tensor.name: tensor for tensor in read_full_checkpoint(path)}
    kept = sorted(OPTIONAL_KEYS - set(source))
    targets = base_tensors(dict(list(model.named_parameters()) + list(model.named_buffers())))
    targets = {k: v for k, v in targets.items() if k not in IGNORED_KEYS and k not in kept}
    check_shapes(
        str(path),
        {k: t.shape for k, t in source.items()},
        {k: tuple(t.shape) for k, t in targets.items()},
        unexpected=lambda key: key not in IGNORED_KEYS,
    )
    with torch.no_grad():
        for name, tensor in targets.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            _read_local(tensor, source[name], local)
    return kept


def _load_dcp_model(model: nn.Module, path: Path, ema: bool) -> list[str]:
    """A DCP folder whose model keys are `model.<fqn>` (the trainer's, Accelerate's) or bare `<fqn>`;
    with `ema`, the parameters from its `ema.<fqn>` keys."""
    metadata = read_checked_metadata(path, require_complete=False)
    stored = stored_shapes(metadata)
    prefix = "model." if any(key.startswith("model.") for key in stored) else ""
    kept = sorted(key for key in OPTIONAL_KEYS if f"{prefix}{key}" not in stored)
    model_state = get_model_state_dict(model)
    state = {k: v for k, v in base_tensors(model_state).items() if k not in IGNORED_KEYS and k not in kept}
    check_shapes(
        str(path),
        {k: shape for k, shape in stored.items() if k.startswith(prefix) and shape is not None},
        {f"{prefix}{k}": tuple(v.shape) for k, v in state.items()},
        unexpected=lambda key: key.removeprefix(prefix) not in IGNORED_KEYS,
    )
    template = {"model": state} if prefix else state
    if ema:
        parameters = {lora.base_name(name) for name, _ in model.named_parameters()}
        averaged = {k: v for k, v in state.items() if k in parameters}
        if not prefix or not any(key.startswith("ema.") for key in stored):
            raise CheckpointError(f"{path} holds no EMA weights (the run had training.ema_decay = 0)")
        check_shapes(
            f"{path} (EMA)",
            {k: shape for k, shape in stored.items() if k.startswith("ema.")},
            {f"ema.{k}": tuple(v.shape) for k, v in averaged.items()},
        )
        template = {"model": {k: v for k, v in state.items() if k not in parameters}, "ema": averaged}
    # checked where the folder has CRC32 lists; required where its COMPLETE marker says they were written
    with warnings.catch_warnings():  # one process without a group (sana2.sample) is a use, not a mistake
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_verified(path, template, require_checksums=bool(read_marker(path).get("checksums")))
    # non-strict: pos_embed (and a null caption the folder lacks, and LoRA adapters) keep their initial value
    loaded = {name: tensor for name, tensor in model_state.items() if not lora.is_adapter(name)}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    return kept


def base_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a base checkpoint holds, by their names there: a LoRA model's without its adapters and
    with its wrapped layers' names (`...qkv.base_layer.weight` is `...qkv.weight`)."""
    return {lora.base_name(name): tensor for name, tensor in tensors.items() if not lora.is_adapter(name)}
