"""torch.save files read and written one tensor at a time, through torch's own serialization.

Reading: `torch.load(mmap=True, weights_only=True)` maps the file and unpickles only its small
`data.pkl` (no code from the file runs); each tensor's pages are read when it is copied out. A
legacy (pre-1.6, non-zip) file cannot be mapped: it is read whole with `torch.load(weights_only=True)`.

Writing: `torch.save` under `torch.serialization.skip_data()` lays down the whole file (pickle,
records, zip directory) with the tensor bytes left as holes; the file is then mapped shared
(`torch.load(mmap=True)` with `MAP_SHARED`) and each tensor is read from its source straight into
its place. The result is a plain torch.save file. Its zip entries carry CRC32 0 (torch.save writes
the same with `torch.serialization.set_crc32_options(False)`); torch.load does not check them.

Pages touched through a mapping count in the process's resident memory for as long as it is
mapped, so a mapping is dropped and made again after `WINDOW_BYTES` have gone through it: resident
memory stays at about one window whatever the file size.
"""

import mmap
import os
from pathlib import Path
from typing import Any

import torch

from sana2.formats.tensors import CheckpointError, SourceTensor, first_line, map_tensors, tensor_leaves
from sana2.staging import ensure_free_space

WINDOW_BYTES = 128 << 20
# torch.save has written zip archives since torch 1.6; older files are a bare pickle stream
ZIP_MAGIC = b"PK\x03\x04"


class _Mapping:
    """`torch.load(path, mmap=True)`'s tensors, loaded again after WINDOW_BYTES have been touched."""

    def __init__(self, path: Path, shared: bool):
        self.path, self.flags = path, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        self.leaves: list[torch.Tensor] | None = None
        self.touched = 0

    def leaf(self, index: int, nbytes: int) -> torch.Tensor:
        """Tensor number `index` (in tensor_leaves order), valid until the next call."""
        if self.leaves is None or (self.touched and self.touched + nbytes > WINDOW_BYTES):
            self.leaves = None  # unmap before mapping again
            with torch.serialization.set_default_mmap_options(self.flags):
                self.leaves = tensor_leaves(torch.load(self.path, mmap=True, weights_only=True))
            self.touched = 0
        self.touched += nbytes
        return self.leaves[index]

    def release(self) -> None:
        self.leaves = None


def read_torch_file(path: str | os.PathLike) -> Any:
    """The object saved in `path`, each tensor replaced by a SourceTensor named by its dotted path.

    A file that is not a torch.save file of tensors and plain containers is a CheckpointError.
    """
    path = Path(path)
    with open(path, "rb") as file:
        zipped = file.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    try:
        root = torch.load(path, map_location="cpu", mmap=zipped, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {_why_unreadable(path, zipped, exc)}") from None
    if not zipped:  # already in memory
        return map_tensors(root, lambda tensor, where: SourceTensor.of(_dotted(where), tensor))
    mapping = _Mapping(path, shared=False)
    mapping.leaves = tensor_leaves(root)  # the first reads go through this load's mapping
    indices = iter(range(len(mapping.leaves)))

    def source(tensor: torch.Tensor, where: tuple) -> SourceTensor:
        index, itemsize = next(indices), tensor.element_size()  # (holding `tensor` would pin the mapping)

        def fill(out: torch.Tensor, start: int) -> None:
            stored = mapping.leaf(index, out.numel() * itemsize)
            out.copy_(stored[start : start + out.shape[0]] if stored.dim() else stored)

        return SourceTensor(_dotted(where), tuple(tensor.shape), tensor.dtype, fill)

    return map_tensors(root, source)


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _why_unreadable(path: Path, zipped: bool, exc: Exception) -> str:
    """One line saying what was expected, without torch's advice to load with weights_only=False."""
    if not zipped:  # (a legacy torch file that fails is as good as any other stranger)
        return "expected a model checkpoint (a torch.save file of tensors or a safetensors file)"
    try:
        classes = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        classes = []
    if classes or "Weights only load failed" in str(exc):
        found = f" ({', '.join(classes[:3])})" if classes else ""
        return f"expected a checkpoint of tensors, but it holds other objects{found}"
    return f"a damaged torch.save file ({first_line(exc)})"


def save_torch_file(path: str | os.PathLike, obj: Any) -> None:
    """torch.save(obj, path), where tensor leaves may be SourceTensors: read one at a time, straight into the file.

    `torch.load(path)` returns `obj` with each SourceTensor read. The file is complete when this
    returns but not yet flushed to disk: `sana2.staging.publish` fsyncs it.
    """
    path = Path(path)
    sources: list[SourceTensor] = []

    def placeholder(leaf, where: tuple) -> torch.Tensor:
        sources.append(leaf if isinstance(leaf, SourceTensor) else SourceTensor.of(_dotted(where), leaf))
        # never written: its pages are never touched, so it takes address space, not memory
        return torch.empty(leaf.shape, dtype=leaf.dtype)

    skeleton = map_tensors(obj, placeholder)
    try:
        with torch.serialization.skip_data():
            torch.save(skeleton, path)
        del skeleton
        # reserve the holes now: a full disk is an error here, not a SIGBUS on a write through the mapping
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except (OSError, RuntimeError) as exc:  # torch's writer reports a failed write as a RuntimeError
        ensure_free_space(path, sum(source.nbytes for source in sources))  # names the sizes if the disk is full
        raise OSError(f"cannot write {path}: {first_line(exc)}") from None
    mapping = _Mapping(path, shared=True)
    try:
        for index, source in enumerate(sources):
            source.read_into(mapping.leaf(index, source.nbytes))
    finally:
        mapping.release()
