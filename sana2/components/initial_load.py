"""Start a sharded model from a full-model file: the reference's .pth, Accelerate's .bin, a plain
state dict, .safetensors, or a DCP folder. Model weights only; optimizer and step start fresh.

Each rank reads only the rows of its own shards: .safetensors through slices, zip-format torch
files through a memory map, DCP folders through DCP's resharding reads, so no rank materialises the
whole model (a legacy non-zip torch file cannot be memory-mapped and is read whole: that format
forces it). `pos_embed` is skipped (the forward never reads it; the reference's loaders drop it).
Any other missing, unexpected or mis-shaped key stops the load with one message naming them all.
"""

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from sana2.components.checkpoint import CheckpointError, load_verified, read_checked_metadata
from sana2.components.ema import clean_name

IGNORED_KEYS = {"pos_embed"}  # never read by the forward; the reference's loaders drop it too
ACCELERATE_MODEL_FILE = "pytorch_model_fsdp.bin"
MAX_PROBLEMS_SHOWN = 20


def _open_safetensors(path: Path):
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(path), framework="pt")
        return {k: (tuple(handle.get_slice(k).get_shape()), lambda a, b, k=k: handle.get_slice(k)[a:b])
                for k in handle.keys()}
    except SafetensorError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _load_torch_file(path: Path):
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:
        if "mmap can only be used" not in str(exc):
            raise CheckpointError(f"cannot read {path}: {exc}") from None
    try:  # not a zip-format torch file: a legacy one cannot be memory-mapped, so it is read whole
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def _open_full_state(path: Path):
    """A mapping name -> (shape, read_rows(start, stop)) over the file, without reading it all."""
    if path.suffix == ".safetensors":
        return _open_safetensors(path)
    state = _load_torch_file(path)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # the reference's epoch_E_step_S.pth
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state dict (found {type(state).__name__})")
    return {k: (tuple(v.shape), lambda a, b, v=v: v[a:b]) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _row_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows of the full tensor that this rank's shard holds (all rows if not a DTensor)."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0]
    local_shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0], offset[0] + local_shape[0]


def _report(path: Path, problems: list[str]) -> None:
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        raise CheckpointError(f"{path} does not match the model: " + "; ".join(problems[:MAX_PROBLEMS_SHOWN])
                              + (f" (and {more} more)" if more > 0 else ""))


def _compare_keys(source_shapes: dict[str, tuple], target_shapes: dict[str, tuple], prefix: str = "") -> list[str]:
    problems = [f"missing {prefix}{k}" for k in target_shapes if k not in source_shapes]
    problems += [f"unexpected {prefix}{k}" for k in source_shapes if k not in target_shapes and k not in IGNORED_KEYS]
    problems += [f"{prefix}{k}: file has shape {source_shapes[k]}, model needs {shape}"
                 for k, shape in target_shapes.items() if k in source_shapes and source_shapes[k] != shape]
    return problems


def load_initial_weights(model: nn.Module, path: str | Path) -> None:
    """Fill `model` (sharded or not) from a full checkpoint; every mismatch is reported by key."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint.initial_load_path {path} does not exist")
    if path.is_dir() and not (path / ".metadata").exists() and (path / ACCELERATE_MODEL_FILE).is_file():
        path = path / ACCELERATE_MODEL_FILE  # the model/ folder of an Accelerate FULL_STATE_DICT checkpoint
    if path.is_dir():
        return _load_dcp_model(model, path)
    targets = {clean_name(n): t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    targets = {k: v for k, v in targets.items() if k not in IGNORED_KEYS}
    source = _open_full_state(path)
    source = {k.removeprefix("module."): v for k, v in source.items()}
    _report(path, _compare_keys({k: shape for k, (shape, _) in source.items()},
                                {k: tuple(t.shape) for k, t in targets.items()}))
    with torch.no_grad():
        for name, tensor in targets.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            start, stop = _row_range(tensor)
            local.copy_(source[name][1](start, stop).reshape(local.shape))


def _load_dcp_model(model: nn.Module, path: Path) -> None:
    """A DCP folder whose model keys are `model.<fqn>` (the trainer's, Accelerate's) or bare `<fqn>`."""
    metadata = read_checked_metadata(path, require_complete=False)
    stored = metadata.state_dict_metadata
    prefix = "model." if any(key.startswith("model.") for key in stored) else ""
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in IGNORED_KEYS}
    stored_shapes = {k.removeprefix(prefix): tuple(entry.size) for k, entry in stored.items()
                     if k.startswith(prefix) and hasattr(entry, "size")}
    _report(path, _compare_keys(stored_shapes, {k: tuple(v.shape) for k, v in state.items()}, prefix))
    load_verified(path, {"model": state} if prefix else state, require_checksums=False)
    # non-strict: pos_embed is not loaded and keeps its initial value
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))
