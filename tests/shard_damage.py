"""Damage inside a safetensors file that its header does not show: bytes of one tensor overwritten in place."""

import json
from pathlib import Path


def overwrite_tensor_bytes(path: Path, name: str, size: int = 4096) -> None:
    """Invert `size` bytes in the middle of tensor `name`'s data (every byte changes; the file keeps its size).

    The offsets come from the header as the safetensors format defines it: an 8-byte little-endian length,
    that many bytes of JSON, then the data section, each tensor's "data_offsets" relative to its start.
    """
    with open(path, "r+b") as file:
        header_size = int.from_bytes(file.read(8), "little")
        begin, end = json.loads(file.read(header_size))[name]["data_offsets"]
        if end - begin < size:
            raise ValueError(f"{path}: tensor {name} holds {end - begin} bytes, fewer than {size}")
        offset = 8 + header_size + begin + (end - begin - size) // 2
        file.seek(offset)
        inverted = bytes(255 - byte for byte in file.read(size))
        file.seek(offset)
        file.write(inverted)
