"""CRC32 of stored tensors, the one integrity check of what sana2 writes: checkpoints and feature shards.

A checkpoint's items are checked from the byte ranges DCP records (`crc32_of_range`, its lists beside
each data file: sana2/formats/dcp_folder.py). A safetensors file written by sana2 (feature shards, the
null caption) carries in its metadata, under `CHECKSUMS_KEY`, the JSON object {tensor name: CRC32 of the
tensor's bytes as stored}; `stored_checksum_error` reads each tensor back in pieces of dim-0 rows
through `safe_open` and names the first whose bytes differ. All of them CRC the bytes in bounded
pieces with `zlib.crc32`, so memory stays one piece whatever the size of a tensor.
"""

import json
import math
import zlib

import torch

from sana2.formats.safetensors_file import DTYPES

CHECKSUMS_KEY = "sana2_crc32"  # safetensors metadata: JSON {tensor name: CRC32}
READ_CHUNK = 1 << 20  # bytes of one piece of a file
ROWS_CHUNK_BYTES = 16 << 20  # about this many bytes of dim-0 rows per piece of a stored tensor


def crc32_of_range(file, offset: int, length: int) -> int:
    """CRC32 of `length` bytes of `file` from `offset` (fewer if the file ends first), read in small pieces."""
    file.seek(offset)
    piece = memoryview(bytearray(min(READ_CHUNK, length)))  # one small buffer, reused: no fresh pages per piece
    crc = 0
    while length > 0:
        count = file.readinto(piece[: min(len(piece), length)])
        if not count:
            break
        crc = zlib.crc32(piece[:count], crc)
        length -= count
    return crc


def crc32_of_tensor(tensor: torch.Tensor, crc: int = 0) -> int:
    """CRC32 of a tensor's bytes in memory order (as safetensors stores them), continuing from `crc`."""
    flat = tensor.detach().contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy(), crc) if flat.numel() else crc


def checksum_metadata(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors metadata entry that records the CRC32 of each of `tensors`."""
    return {CHECKSUMS_KEY: json.dumps({name: crc32_of_tensor(tensor) for name, tensor in tensors.items()})}


def recorded_checksums(metadata: dict[str, str] | None) -> dict[str, int] | None:
    """{tensor name: CRC32} recorded in a safetensors file's metadata; None for a file written without them.

    A recording that does not parse is a ValueError.
    """
    text = (metadata or {}).get(CHECKSUMS_KEY)
    if text is None:
        return None
    checksums = json.loads(text)
    if not (isinstance(checksums, dict) and all(isinstance(v, int) for v in checksums.values())):
        raise ValueError(f"metadata {CHECKSUMS_KEY!r} is not an object of tensor name -> CRC32")
    return checksums


def stored_checksum_error(handle, checksums: dict[str, int], names) -> str | None:
    """Which of `names` in an open safetensors file (`safe_open`) does not match its recorded CRC32, as a
    sentence; None when all match. Each tensor is read back in pieces of dim-0 rows."""
    for name in names:
        if name not in checksums:
            return f"tensor '{name}' has no CRC32 recorded in its metadata {CHECKSUMS_KEY!r}"
        view = handle.get_slice(name)
        shape = view.get_shape()
        crc = 0
        if not shape:
            crc = crc32_of_tensor(handle.get_tensor(name))
        else:
            row_bytes = math.prod(shape[1:]) * DTYPES[view.get_dtype()].itemsize
            step = max(1, ROWS_CHUNK_BYTES // max(row_bytes, 1))
            for start in range(0, shape[0], step):
                crc = crc32_of_tensor(view[start : start + step], crc)
        if crc != checksums[name]:
            return f"tensor '{name}' is corrupt: its bytes do not match their CRC32 (recorded when it was written)"
    return None
