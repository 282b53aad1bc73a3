"""torch.save files read and written one tensor at a time, through torch's own serialization.

Reading: `torch.load(mmap=True, weights_only=True)` maps the file and unpickles only its small
`data.pkl` (no code from the file runs); each tensor's pages are read when it is copied out. Pages
touched through a mapping count in the process's resident memory for as long as it is mapped, so
the file is mapped again after every `WINDOW_BYTES` read: resident memory stays at about one window
whatever the file size. A legacy (pre-1.6, non-zip) file cannot be mapped: it is read whole with
`torch.load(weights_only=True)`.

Writing: `torch.save` under `torch.serialization.skip_data()` lays down the whole file (pickle,
records, zip directory) and, instead of each tensor's bytes, seeks past the room they take. The file
object it writes through notes where those seeks start; each tensor is then read from its source
into one reused buffer and written at its place with `os.pwrite`. (Writing through a shared mapping
of the file, `torch.load(mmap=True)` with MAP_SHARED, works too but took about 30% more CPU time:
every page is faulted in and zeroed first, and the mapping must be redone every window to bound
memory.) The places are checked against where `torch.load(mmap=True)` finds the tensors before
anything is written. The result is a plain torch.save file whose tensor records carry CRC32 0 in
the zip directory (as every record does when torch.save runs with `set_crc32_options(False)`);
torch.load does not check them.
"""

import io
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

    def __init__(self, path: Path):
        self.path = path
        self.leaves: list[torch.Tensor] | None = None
        self.touched = 0

    def leaf(self, index: int, nbytes: int) -> torch.Tensor:
        """Tensor number `index` (in tensor_leaves order), valid until the next call."""
        if self.leaves is None or (self.touched and self.touched + nbytes > WINDOW_BYTES):
            self.leaves = None  # unmap before mapping again
            with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
                self.leaves = tensor_leaves(torch.load(self.path, mmap=True, weights_only=True))
            self.touched = 0
        self.touched += nbytes
        return self.leaves[index]


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
    mapping = _Mapping(path)
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


class _RoomNoter(io.RawIOBase):
    """The file torch.save writes through: under skip_data it seeks forward past each storage's bytes."""

    def __init__(self, file):
        super().__init__()
        self.file = file
        self.rooms: list[tuple[int, int]] = []  # (offset, nbytes) of each skipped storage, in order

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR and offset > 0:
            self.rooms.append((self.file.tell(), offset))
        return self.file.seek(offset, whence)

    def flush(self) -> None:
        self.file.flush()


def save_torch_file(path: str | os.PathLike, obj: Any) -> None:
    """torch.save(obj, path), where tensor leaves may be SourceTensors: read one at a time, straight into the file."""
    save_torch_files({path: obj})


def save_torch_files(files: dict[str | os.PathLike, Any]) -> None:
    """`save_torch_file` for several files at once: a SourceTensor found in more than one is read once.

    `torch.load(path)` returns each object with every SourceTensor read. The files are complete
    when this returns but not yet flushed to disk: `sana2.staging.publish` fsyncs them.
    """
    places: dict[int, list] = {}  # id(source) -> [(source, file, offset), ...], in the order first met
    opened = []
    try:
        for path, obj in files.items():
            opened.append(open(path, "wb+", buffering=0))  # unbuffered: nothing left to fail at close
            for source, offset in _lay_down(Path(path), opened[-1], obj):
                places.setdefault(id(source), []).append((source, opened[-1], offset))
        buffer = torch.empty(max((p[0][0].nbytes for p in places.values()), default=0), dtype=torch.uint8)
        for copies in places.values():
            data = memoryview(copies[0][0].read_bytes(buffer))
            for _, file, offset in copies:
                _write_at(file, data, offset)
    finally:
        for file in opened:
            file.close()


def _lay_down(path: Path, file, obj: Any) -> list[tuple[SourceTensor, int]]:
    """Write `obj`'s torch.save file without tensor bytes; return each non-empty tensor's source and byte offset."""
    sources: list[SourceTensor] = []

    def placeholder(leaf, where: tuple) -> torch.Tensor:
        sources.append(leaf if isinstance(leaf, SourceTensor) else SourceTensor.of(_dotted(where), leaf))
        # never written: its pages are never touched, so it takes address space, not memory
        return torch.empty(leaf.shape, dtype=leaf.dtype)

    skeleton = map_tensors(obj, placeholder)
    writer = _RoomNoter(file)
    try:
        with torch.serialization.skip_data():
            torch.save(skeleton, writer)
    except (OSError, RuntimeError) as exc:  # torch's writer reports a failed write as a RuntimeError
        ensure_free_space(path, sum(source.nbytes for source in sources))  # names the sizes if the disk is full
        raise OSError(f"cannot write {path}: {first_line(exc)}") from None
    del skeleton
    nonempty = [source for source in sources if source.nbytes]
    if not nonempty:
        return []
    # where torch.load finds the tensors must be where the bytes go (base-independent: offset differences)
    stored = [t for t in tensor_leaves(torch.load(path, mmap=True, weights_only=True)) if t.nbytes]
    found = [t.untyped_storage().data_ptr() - stored[0].untyped_storage().data_ptr() for t in stored]
    rooms = writer.rooms
    if [n for _, n in rooms] != [s.nbytes for s in nonempty] or found != [o - rooms[0][0] for o, _ in rooms]:
        raise RuntimeError(f"{path}: torch.save did not lay out the tensors as expected; cannot fill them in")
    return [(source, offset) for source, (offset, _) in zip(nonempty, rooms)]


def _write_at(file, data: memoryview, offset: int) -> None:
    try:
        while data:
            written = os.pwrite(file.fileno(), data, offset)
            data, offset = data[written:], offset + written
    except OSError as exc:  # (pwrite's error names no file)
        raise OSError(exc.errno, exc.strerror, file.name) from None
