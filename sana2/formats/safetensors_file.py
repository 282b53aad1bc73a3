"""safetensors files and folders (one file, or an index and its shards), read and written one tensor at a time.

Reading goes through `safetensors.safe_open` with its `pread` backend: each read (a whole tensor,
or a range of dim-0 rows through `get_slice`) copies just those bytes, and nothing stays mapped.

A folder holds `<stem>.safetensors`, or shards `<stem>-00001-of-0000N.safetensors` with
`<stem>.safetensors.index.json` ({"metadata": {"total_size": ...}, "weight_map": {key: shard}}), as
Hugging Face libraries write them (stem "model", or "diffusion_pytorch_model" for diffusers).
"""

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from sana2.formats.tensors import CheckpointError, SourceTensor, first_line

# the format's dtype names (https://github.com/huggingface/safetensors, "Format")
DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
HEADER_ALIGNMENT = 8  # the data section starts 8-byte aligned, as the safetensors library writes it
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"


def index_name(stem: str = "model") -> str:
    return f"{stem}{INDEX_SUFFIX}"


def shard_name(index: int, count: int, stem: str = "model") -> str:
    return f"{stem}-{index + 1:05d}-of-{count:05d}{SUFFIX}"


# -- reading -------------------------------------------------------------------------------------
def read_safetensors(path: str | os.PathLike) -> list[SourceTensor]:
    """The tensors of one .safetensors file, in file order. A damaged file is a CheckpointError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"safetensors file {path} is missing")
    try:
        handle = safe_open(path, framework="pt", backend="pread")
        tensors = []
        for name in handle.offset_keys():
            view = handle.get_slice(name)
            tensors.append(_source(path, handle, name, tuple(view.get_shape()), DTYPES[view.get_dtype()]))
    except Exception as exc:  # SafetensorError, a dtype this reader does not know
        raise CheckpointError(f"cannot read {path}: {first_line(exc)}") from None
    return tensors


def _source(path: Path, handle, name: str, shape: tuple, dtype: torch.dtype) -> SourceTensor:
    def fill(out: torch.Tensor, start: int) -> None:
        try:
            if not shape or (start == 0 and out.shape[0] == shape[0]):
                out.copy_(handle.get_tensor(name))
            else:
                out.copy_(handle.get_slice(name)[start : start + out.shape[0]])
        except Exception as exc:
            raise CheckpointError(f"cannot read {name} from {path}: {first_line(exc)}") from None

    return SourceTensor(name, shape, dtype, fill)


def safetensors_files(path: str | os.PathLike, stem: str = "*") -> list[Path]:
    """The files of a safetensors checkpoint: the file itself, or a folder's index shards or single file.

    In a folder, only `<stem>.safetensors` or `<stem>.safetensors.index.json` count ("*": any stem),
    so other safetensors files beside a model's (diffusers' folder holds sana2's null caption too)
    are not taken for part of it.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    indexes = sorted(path.glob(f"{stem}{INDEX_SUFFIX}"))
    if len(indexes) == 1:
        return [path / name for name in sorted(set(_weight_map(indexes[0]).values()))]
    singles = sorted(path.glob(f"{stem}{SUFFIX}"))
    if len(indexes) > 1 or len(singles) != 1:
        found = ", ".join(p.name for p in indexes + singles) or "none"
        raise CheckpointError(f"{path}: expected one {INDEX_SUFFIX} or one {SUFFIX} file, found {found}")
    return singles


def is_safetensors_folder(path: Path) -> bool:
    return path.is_dir() and (any(path.glob(f"*{INDEX_SUFFIX}")) or any(path.glob(f"*{SUFFIX}")))


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("its weight_map is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot read {index}: {first_line(exc)}") from None
    return weight_map


def read_safetensors_checkpoint(path: str | os.PathLike, stem: str = "*") -> list[SourceTensor]:
    """The tensors of a .safetensors file or folder (see `safetensors_files`), in file order; an index
    must match its shards."""
    path = Path(path)
    files = safetensors_files(path, stem)
    tensors, holder = [], {}
    for file in files:
        for tensor in read_safetensors(file):
            tensors.append(tensor)
            holder[tensor.name] = file.name
    indexes = list(path.glob(f"{stem}{INDEX_SUFFIX}")) if path.is_dir() else []
    if indexes:
        weight_map = _weight_map(indexes[0])
        wrong = [name for name in weight_map if holder.get(name) != weight_map[name]]
        wrong += [name for name in holder if name not in weight_map]
        if wrong:
            raise CheckpointError(
                f"{indexes[0]} does not match its shards: it puts {wrong[0]} in "
                f"{weight_map.get(wrong[0], 'no shard')}, the shards hold it in "
                f"{holder.get(wrong[0], 'none')} ({len(wrong)} such tensors)"
            )
    return tensors


# -- writing -------------------------------------------------------------------------------------
def write_safetensors(path: str | os.PathLike, tensors: Sequence[SourceTensor], metadata: dict[str, str]) -> None:
    """One .safetensors file holding `tensors` (in this order, under their names), read one at a time.

    The header is written here from the format's definition (8-byte little-endian length, JSON of
    name -> dtype, shape, data_offsets, padded with spaces to 8 bytes) because the library has no
    streaming writer: `safetensors.torch.save_file` and `safetensors.serialize_file` take every
    tensor of the file at once, as memory that must stay alive for the whole call, so a 6 GB file
    would need 6 GB of memory. The result is read back by `safe_open` (see the tests).
    """
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{tensor.name}: dtype {tensor.dtype} has no safetensors name")
        header[tensor.name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    buffer = torch.empty(max((t.nbytes for t in tensors), default=0), dtype=torch.uint8)  # reused by every tensor
    with open(path, "wb") as file:
        file.write(len(encoded).to_bytes(8, "little") + encoded)
        for tensor in tensors:
            tensor.read_into(buffer[: tensor.nbytes].view(tensor.dtype).view(tensor.shape))
            file.write(buffer[: tensor.nbytes].numpy())


def plan_shards(tensors: Sequence[SourceTensor], max_shard_bytes: int) -> list[list[SourceTensor]]:
    """Split `tensors`, in order, into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[SourceTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def write_safetensors_folder(
    folder: Path, tensors: Sequence[SourceTensor], metadata: dict[str, str], max_shard_bytes: int, stem: str = "model"
) -> list[Path]:
    """`<stem>.safetensors`, or shards and their index above `max_shard_bytes`, into the existing `folder`."""
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        names = [f"{stem}{SUFFIX}"]
    else:
        names = [shard_name(i, len(shards), stem) for i in range(len(shards))]
        weight_map = {tensor.name: name for name, shard in zip(names, shards) for tensor in shard}
        index = {"metadata": {**metadata, "total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
        (folder / index_name(stem)).write_text(json.dumps(index, indent=2))
    for name, shard in zip(names, shards):
        write_safetensors(folder / name, shard, metadata)
    return [folder / name for name in names]
