"""Write and read .safetensors files one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
range; "__metadata__" -> str -> str), then the raw tensor bytes. Every shape and dtype is known
before any data is read, so the header goes first and each tensor is appended as it arrives.
Reading uses positioned reads instead of a memory map, so resident memory stays one tensor.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from sana2.tools.torch_files import ScratchBuffer, as_bytes, read_exactly

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
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def encode_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for entry in entries:
        if entry.dtype not in DTYPE_NAMES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} has no safetensors name")
        header[entry.name] = {
            "dtype": DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(encoded)) + encoded


class SafetensorsStream:
    """Write `entries` to `path`: the header now, then each tensor's bytes with `write()`, in order.

    Use it as a context manager: it closes the file on success and abandons it on an error.
    """

    def __init__(self, path: str | os.PathLike, entries: list[Entry], metadata: dict[str, str]):
        self.entries = entries
        self.file = open(path, "wb")
        self.file.write(encode_header(entries, metadata))
        self.written = 0

    def write(self, tensor: torch.Tensor) -> None:
        entry = self.entries[self.written]
        if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise ValueError(
                f"{entry.name}: got {tuple(tensor.shape)} {tensor.dtype}, expected {entry.shape} {entry.dtype}"
            )
        self.file.write(as_bytes(tensor.contiguous()))
        self.written += 1

    def close(self) -> None:
        if self.written != len(self.entries):
            raise ValueError(f"{len(self.entries) - self.written} tensors were never written")
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:  # the caller deletes the file; a full disk may fail the final flush too
            try:
                self.file.close()
            except OSError:
                pass
        return False


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Split `entries`, in order, into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def index_json(shards: list[list[Entry]], metadata: dict[str, str]) -> str:
    weight_map = {entry.name: shard_file_name(i, len(shards)) for i, shard in enumerate(shards) for entry in shard}
    total = sum(entry.nbytes for shard in shards for entry in shard)
    return json.dumps({"metadata": {**metadata, "total_size": total}, "weight_map": weight_map}, indent=2)


class SafetensorsFile:
    """One .safetensors file: its header parsed, tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.file = open(self.path, "rb")
        size = self.size = os.fstat(self.file.fileno()).st_size
        if size < 8:
            raise ValueError(f"it is {size} bytes long, too short for a header")
        (length,) = struct.unpack("<Q", self.file.read(8))
        if 8 + length > size:
            raise ValueError(f"its header claims {length} bytes, the file has {size}")
        header = json.loads(self.file.read(length))
        self.metadata: dict[str, str] = header.pop("__metadata__", {})
        self.data_start = 8 + length
        self.header = header

    def names(self) -> list[str]:
        return sorted(self.header, key=lambda name: self.header[name]["data_offsets"][0])

    def entry(self, name: str) -> Entry:
        info = self.header[name]
        return Entry(name, tuple(info["shape"]), DTYPES[info["dtype"]])

    def read(self, name: str, buffer: ScratchBuffer | None = None) -> torch.Tensor:
        """The tensor, in fresh memory or in `buffer`'s (then valid until the buffer's next use)."""
        entry = self.entry(name)
        start, end = self.header[name]["data_offsets"]
        if end - start != entry.nbytes:
            raise ValueError(f"{self.path}: {name} spans {end - start} bytes, its shape needs {entry.nbytes}")
        if buffer is not None:
            out = buffer.tensor(entry.shape, entry.dtype)
        else:
            out = torch.empty(entry.shape, dtype=entry.dtype)
        read_exactly(self.file, self.data_start + start, as_bytes(out))
        return out

    def read_rows_into(self, name: str, start: int, out: torch.Tensor) -> None:
        """Rows [start, start + len(out)) of dim 0 of `name` into `out` (contiguous); all of a 0-dim tensor."""
        entry = self.entry(name)
        begin, end = self.header[name]["data_offsets"]
        if end - begin != entry.nbytes:
            raise ValueError(f"{self.path}: {name} spans {end - begin} bytes, its shape needs {entry.nbytes}")
        row_bytes = torch.Size(entry.shape[1:]).numel() * entry.dtype.itemsize if entry.shape else 0
        first = start * row_bytes
        nbytes = out.numel() * out.element_size()
        if out.dtype != entry.dtype or first + nbytes > entry.nbytes:
            raise ValueError(
                f"{self.path}: {nbytes} bytes of {out.dtype} at byte {first} are not inside "
                f"{name} ({entry.nbytes} bytes of {entry.dtype})"
            )
        read_exactly(self.file, self.data_start + begin + first, as_bytes(out))

    def close(self) -> None:
        self.file.close()


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The files of a safetensors export: the file itself, or a folder's single file or index + shards."""
    path = Path(path)
    if path.is_file():
        return [path]
    if (path / INDEX_NAME).is_file():
        weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    return [path / SINGLE_NAME]
