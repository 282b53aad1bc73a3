"""Read a full (unsharded) model checkpoint one tensor, or one range of dim-0 rows, at a time.

The one reader of full-model files, used by `checkpoint.initial_load_path` (each rank reads only
the rows of its own shards) and by `sana2-convert --to-dcp` (one whole tensor at a time):

- a torch.save file in zip format: the reference's `{"state_dict": ...}` .pth, Accelerate's
  `pytorch_model_fsdp.bin` (or the `model/` folder holding it), a plain state dict. Its pickle
  is read by `TorchArchive` (no code from the file runs), each tensor's bytes on demand;
- a legacy (non-zip) torch.save file: that format cannot be read in parts, so
  torch.load(weights_only=True) reads it whole;
- safetensors: one file, or a folder with `model.safetensors` or an index and its shards (what
  `sana2-convert --format safetensors` and Hugging Face write).

Keys lose a leading `module.` (DDP's wrapper). Nothing is dropped: whether `pos_embed` matters
is the caller's decision. Every problem is a CheckpointError naming the file.
"""

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sana2.components.checkpoint import CheckpointError
from sana2.tools.safetensors_files import INDEX_NAME, SINGLE_NAME, Entry, SafetensorsFile, safetensors_files
from sana2.tools.torch_files import ScratchBuffer, StoredTensor, TorchArchive

ACCELERATE_MODEL_FILE = "pytorch_model_fsdp.bin"  # Accelerate's FULL_STATE_DICT model file
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6; older files are a bare pickle stream
DDP_PREFIX = "module."
FOLDER_MARKERS = (INDEX_NAME, SINGLE_NAME, ACCELERATE_MODEL_FILE)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _kind(value) -> str:
    """What a pickled value is, for messages (an unresolved class by its own name)."""
    return getattr(value, "qualified_name", type(value).__name__)


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the input; `reader(buffer)` reads it whole (into fresh memory when buffer is None).

    `fill_rows(start, out)`, where given, fills `out` with rows [start, start + len(out)) of the
    tensor without reading the others (all of a 0-dim tensor).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    reader: Callable[[ScratchBuffer | None], torch.Tensor]
    fill_rows: Callable[[int, torch.Tensor], None] | None = None

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def read(self, buffer: ScratchBuffer | None = None) -> torch.Tensor:
        return self.reader(buffer)

    def read_rows(self, start: int, stop: int, buffer: ScratchBuffer | None = None) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (all of a 0-dim tensor), in fresh memory or in `buffer`'s."""
        if not self.shape:
            return self.read(buffer)
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"{self.name}: rows {start}..{stop} are outside its {self.shape[0]} rows")
        if self.fill_rows is None:
            return self.read(buffer)[start:stop]
        shape = (stop - start, *self.shape[1:])
        out = buffer.tensor(shape, self.dtype) if buffer is not None else torch.empty(shape, dtype=self.dtype)
        self.fill_rows(start, out)
        return out

    @classmethod
    def from_rows(
        cls,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        where: Path,
        fill_rows: Callable[[int, torch.Tensor], None],
    ) -> "SourceTensor":
        """A tensor read through `fill_rows`; a failed read is a CheckpointError naming `where` and the tensor."""

        def checked_fill(start: int, out: torch.Tensor) -> None:
            try:
                fill_rows(start, out)
            except (EOFError, ValueError, RuntimeError) as exc:
                raise CheckpointError(f"cannot read {name} from {where}: {_first_line(exc)}") from None

        def reader(buffer: ScratchBuffer | None) -> torch.Tensor:
            out = buffer.tensor(shape, dtype) if buffer is not None else torch.empty(shape, dtype=dtype)
            checked_fill(0, out)
            return out

        return cls(name, tuple(shape), dtype, reader, checked_fill)


class FullCheckpoint:
    """The model tensors of a full checkpoint, in file order; `path` is the file (or safetensors folder) read."""

    def __init__(self, path: Path, tensors: list[SourceTensor], files: list):
        self.path = path
        self.tensors = tensors
        self._files = files

    def by_name(self) -> dict[str, SourceTensor]:
        return {tensor.name: tensor for tensor in self.tensors}

    def close(self) -> None:
        for file in self._files:
            file.close()
        self._files = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def is_full_checkpoint(path: Path) -> bool:
    """Whether `path` is for this reader: a file, or a folder of safetensors or Accelerate's model/ (not DCP)."""
    path = Path(path)
    if path.is_file():
        return True
    return (
        path.is_dir()
        and not (path / ".metadata").exists()
        and any((path / marker).is_file() for marker in FOLDER_MARKERS)
    )


def open_full_checkpoint(path: str | Path) -> FullCheckpoint:
    """Open a full checkpoint (see the module docstring) without reading its tensors."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir():
        if (path / ".metadata").exists():
            raise CheckpointError(f"{path} is a DCP checkpoint folder, not a full-model file")
        if (path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file():
            return _open_safetensors_folder(path)
        if not (path / ACCELERATE_MODEL_FILE).is_file():
            raise CheckpointError(f"{path} holds none of {', '.join(FOLDER_MARKERS)}")
        path = path / ACCELERATE_MODEL_FILE  # the model/ folder of an Accelerate FULL_STATE_DICT checkpoint
    if path.suffix == ".safetensors":
        return _open_safetensors(path)
    return _open_torch_file(path)


# -- torch.save files ---------------------------------------------------------------------------
def _open_torch_file(path: Path) -> FullCheckpoint:
    with open(path, "rb") as file:
        zipped = file.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if not zipped:
        try:  # a legacy torch.save stream cannot be read in parts: read whole, without running code
            root = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"cannot read {path}: {_first_line(exc)}") from None
        return FullCheckpoint(path, _state_dict_tensors(path, root, torch.Tensor, _in_memory_rows), [])
    file = open(path, "rb")
    try:
        try:
            root = TorchArchive(file).root
        except Exception as exc:  # a damaged zip or pickle: one line naming the file
            raise CheckpointError(f"cannot read {path}: {_first_line(exc)}") from None
        tensors = _state_dict_tensors(path, root, StoredTensor, lambda stored: stored.read_rows_into)
    except BaseException:
        file.close()
        raise
    return FullCheckpoint(path, tensors, [file])


def _state_dict_tensors(path: Path, root, leaf: type, rows_of: Callable) -> list[SourceTensor]:
    """The tensors of the state dict in `root` (the reference's {"state_dict": ...} or a plain one)."""
    state = root
    if isinstance(root, dict) and isinstance(root.get("state_dict"), dict):
        state = root["state_dict"]  # the reference's epoch_<E>_step_<S>.pth
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds no state dict (found {_kind(state)})")
    tensors = []
    for name, value in state.items():
        if not isinstance(value, leaf):
            raise CheckpointError(f"{path}: entry {name!r} of the state dict is not a tensor (found {_kind(value)})")
        tensors.append(SourceTensor.from_rows(str(name), tuple(value.shape), value.dtype, path, rows_of(value)))
    return _strip_ddp_prefix(path, tensors)


def _in_memory_rows(tensor: torch.Tensor) -> Callable[[int, torch.Tensor], None]:
    """fill_rows for a tensor already in memory (a legacy file's)."""

    def fill(start: int, out: torch.Tensor) -> None:
        out.copy_(tensor[start : start + out.shape[0]] if tensor.dim() else tensor)

    return fill


def _strip_ddp_prefix(path: Path, tensors: list[SourceTensor]) -> list[SourceTensor]:
    stripped, seen = [], set()
    for tensor in tensors:
        if tensor.name.startswith(DDP_PREFIX):
            tensor = SourceTensor(
                tensor.name.removeprefix(DDP_PREFIX), tensor.shape, tensor.dtype, tensor.reader, tensor.fill_rows
            )
        if tensor.name in seen:
            raise CheckpointError(f"{path} holds {tensor.name} twice (with and without the {DDP_PREFIX!r} prefix)")
        seen.add(tensor.name)
        stripped.append(tensor)
    return stripped


# -- safetensors ----------------------------------------------------------------------------------
def _open_safetensors_folder(folder: Path) -> FullCheckpoint:
    index = folder / INDEX_NAME
    try:
        paths = safetensors_files(folder)
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        if weight_map is not None and not isinstance(weight_map, dict):
            raise ValueError("its weight_map is not a mapping")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {index}: {_first_line(exc)}") from None
    files, tensors = _open_safetensors_files(paths)
    if weight_map is not None:
        found = {tensor.name: shard for tensor, shard in tensors}
        wrong = [name for name in weight_map if found.get(name) != weight_map[name]]
        wrong += [name for name in found if name not in weight_map]
        if wrong:
            for file in files:
                file.close()
            raise CheckpointError(
                f"{index} does not match its shards: it puts {wrong[0]} in "
                f"{weight_map.get(wrong[0], 'no shard')}, the shards hold it in "
                f"{found.get(wrong[0], 'none')} ({len(wrong)} such tensors)"
            )
    return _safetensors_checkpoint(folder, files, [tensor for tensor, _ in tensors])


def _open_safetensors(path: Path) -> FullCheckpoint:
    files, tensors = _open_safetensors_files([path])
    return _safetensors_checkpoint(path, files, [tensor for tensor, _ in tensors])


def _safetensors_checkpoint(where: Path, files: list, tensors: list[SourceTensor]) -> FullCheckpoint:
    try:
        return FullCheckpoint(where, _strip_ddp_prefix(where, tensors), files)
    except CheckpointError:
        for file in files:
            file.close()
        raise


def _open_safetensors_files(paths: list[Path]) -> tuple[list[SafetensorsFile], list[tuple[SourceTensor, str]]]:
    """Each file opened, and each tensor with the name of the file holding it, in file order."""
    files: list[SafetensorsFile] = []
    tensors: list[tuple[SourceTensor, str]] = []
    try:
        for path in paths:
            if not path.is_file():
                raise CheckpointError(f"safetensors file {path} is missing")
            try:
                file = SafetensorsFile(path)
            except Exception as exc:  # a damaged header: one line naming the file
                raise CheckpointError(f"cannot read {path}: {_first_line(exc)}") from None
            files.append(file)
            for name in file.names():
                entry = _checked_entry(file, name)
                fill = functools.partial(file.read_rows_into, name)
                tensors.append((SourceTensor.from_rows(name, entry.shape, entry.dtype, path, fill), path.name))
    except CheckpointError:
        for file in files:
            file.close()
        raise
    return files, tensors


def _checked_entry(file: SafetensorsFile, name: str) -> Entry:
    """The entry of `name`, after checking its byte range fits its shape and the file."""
    try:
        entry = file.entry(name)
        start, end = file.header[name]["data_offsets"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file.path}: bad header entry for {name}: {_first_line(exc)}") from None
    if end - start != entry.nbytes:
        raise CheckpointError(
            f"cannot read {file.path}: {name} spans {end - start} bytes, its shape "
            f"{entry.shape} {entry.dtype} needs {entry.nbytes}"
        )
    if file.data_start + end > file.size:
        raise CheckpointError(
            f"{file.path} is truncated: {name} ends at byte {file.data_start + end}, the file has {file.size}"
        )
    return entry
