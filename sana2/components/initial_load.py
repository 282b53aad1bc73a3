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
Any other missing, unexpected or mis-shaped key stops the load with one message naming them (the
same report a resume gives).
"""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sana2.formats.dcp_folder import load_verified, read_checked_metadata, read_marker, stored_shapes
from sana2.formats.full_model import is_full_checkpoint, read_full_checkpoint
from sana2.formats.tensors import CheckpointError, SourceTensor, check_shapes

IGNORED_KEYS = {"pos_embed"}  # never read by the forward; the reference's loaders drop it too


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


def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    """Fill `model` (sharded or not) from a full checkpoint or a DCP folder; every mismatch is reported by key."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    if not is_full_checkpoint(path):
        return _load_dcp_model(model, path)
    targets = dict(list(model.named_parameters()) + list(model.named_buffers()))
    targets = {k: v for k, v in targets.items() if k not in IGNORED_KEYS}
    source = {tensor.name: tensor for tensor in read_full_checkpoint(path)}
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


def _load_dcp_model(model: nn.Module, path: Path) -> None:
    """A DCP folder whose model keys are `model.<fqn>` (the trainer's, Accelerate's) or bare `<fqn>`."""
    metadata = read_checked_metadata(path, require_complete=False)
    stored = stored_shapes(metadata)
    prefix = "model." if any(key.startswith("model.") for key in stored) else ""
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in IGNORED_KEYS}
    check_shapes(
        str(path),
        {k: shape for k, shape in stored.items() if k.startswith(prefix) and shape is not None},
        {f"{prefix}{k}": tuple(v.shape) for k, v in state.items()},
        unexpected=lambda key: key.removeprefix(prefix) not in IGNORED_KEYS,
    )
    # checked where the folder has CRC32 lists; required where its COMPLETE marker says they were written
    load_verified(
        path, {"model": state} if prefix else state, require_checksums=bool(read_marker(path).get("checksums"))
    )
    # non-strict: pos_embed is not loaded and keeps its initial value
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
