"""Start a sharded model from a full-model file: the reference's .pth, Accelerate's .bin, a plain
state dict, .safetensors, or a DCP folder. Model weights only; optimizer and step start fresh.

Each rank reads only the rows of its own shards: .safetensors through slices, zip-format torch
files through a memory map, so no rank materialises the whole model (a legacy non-zip torch file
cannot be memory-mapped and is read whole: that format forces it).
"""

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sana2.components.checkpoint import CheckpointError, read_checked_metadata
from sana2.components.ema import clean_name

IGNORED_KEYS = {"pos_embed"}  # never read by the forward; the reference's loaders drop it too


def _open_full_state(path: Path):
    """A mapping name -> (shape, read_rows(start, stop)) over the file, without reading it all."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        handle = safe_open(str(path), framework="pt")
        return {k: (tuple(handle.get_slice(k).get_shape()), lambda a, b, k=k: handle.get_slice(k)[a:b])
                for k in handle.keys()}
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # legacy (non-zip) format: cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state dict (found {type(state).__name__})")
    return {k: (tuple(v.shape), lambda a, b, v=v: v[a:b]) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _row_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows of the full tensor that this rank's shard holds (all rows if not a DTensor)."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0], offset[0] + local_shape[0]


def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    """Fill `model` (sharded or not) from a full checkpoint; every mismatch is reported by key."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    targets = {clean_name(n): t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    targets = {k: v for k, v in targets.items() if k not in IGNORED_KEYS}
    if path.is_dir():
        return _load_dcp_model(model, path, targets)
    source = _open_full_state(path)
    source = {k.removeprefix("module."): v for k, v in source.items()}
    problems = [f"missing {k}" for k in targets if k not in source]
    problems += [f"unexpected {k}" for k in source if k not in targets and k not in IGNORED_KEYS]
    problems += [f"{k}: file has shape {source[k][0]}, model needs {tuple(t.shape)}"
                 for k, t in targets.items() if k in source and source[k][0] != tuple(t.shape)]
    if problems:
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(problems[:20])
                              + (f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""))
    with torch.no_grad():
        for name, tensor in targets.items():
            start, stop = _row_range(tensor)
            rows = source[name][1](start, stop)
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(rows.reshape(local.shape))


def _load_dcp_model(model: nn.Module, path: Path, targets: dict) -> None:
    metadata = read_checked_metadata(path, require_complete=False)
    state = get_model_state_dict(model)
    state = {k: v for k, v in state.items() if k not in IGNORED_KEYS}
    stored = metadata.state_dict_metadata
    problems = [f"missing model.{k}" for k in state if f"model.{k}" not in stored]
    problems += [f"model.{k}: folder has shape {tuple(stored[f'model.{k}'].size)}, model needs {tuple(v.shape)}"
                 for k, v in state.items() if f"model.{k}" in stored and tuple(stored[f"model.{k}"].size) != tuple(v.shape)]
    if problems:
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(problems[:20]))
    dcp.load({"model": state}, checkpoint_id=str(path))
    # non-strict: pos_embed is not loaded and keeps its initial value
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
