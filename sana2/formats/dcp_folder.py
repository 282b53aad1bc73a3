"""DCP step folders: their integrity (CRC32 lists, COMPLETE, metadata checks) and reading them one tensor at a time.

A folder holds DCP's files (`.metadata`, `__<rank>_0.distcp`), beside each data file a CRC32 list
of every item it stores (`__<rank>_0.distcp.crc32.json`, written by `ChecksummingWriter`), and a
`COMPLETE` marker (JSON) once the save is whole. DCP reads flipped bytes inside a tensor without
complaint; `VerifyingReader` checks every item it reads against the list, so a load names the file
and the key of a corrupt item instead of returning garbage. It is the one CRC check: the trainer's
loads, initial loads and the converter all read through it.

`DcpCheckpoint` reads a folder without a process group through `dcp.load` itself: a partial state
dict of one key at a time, so a checkpoint saved at any world size is read one full tensor at a time.
"""

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from sana2.formats.checksums import crc32_of_range
from sana2.formats.tensors import CheckpointError, DamagedCheckpointError, SourceTensor

COMPLETE_MARKER = "COMPLETE"
CHECKSUM_SUFFIX = ".crc32.json"


# -- integrity: per-item CRC32 beside each data file ---------------------------------------------


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that also writes, per data file, the CRC32 of every item it stored."""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        by_file: dict[str, list] = {}
        for result in future.wait():
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        for relative_path, results in by_file.items():
            _write_checksums(Path(self.path), relative_path, results)
        return future


def _write_checksums(folder: Path, relative_path: str, results: list) -> None:
    # read back from the page cache just written: robust to how DCP serialises each item
    items = {}
    with open(folder / relative_path, "rb") as data:
        for result in sorted(results, key=lambda r: r.storage_data.offset):
            info = result.storage_data
            items[str(info.offset)] = {
                "key": result.index.fqn,
                "length": info.length,
                "crc32": crc32_of_range(data, info.offset, info.length),
            }
    sidecar = folder / f"{relative_path}{CHECKSUM_SUFFIX}"
    with open(sidecar, "w") as out:
        json.dump(items, out)
        out.flush()
        os.fsync(out.fileno())


class VerifyingReader(FileSystemReader):
    """FileSystemReader that checks each item's bytes against the CRC32 list of its file.

    Its metadata is read once: a reader used for many loads of one folder (one tensor each) does
    not unpickle `.metadata` again for every one.
    """

    def __init__(self, path: str | os.PathLike, require_checksums: bool):
        super().__init__(path)
        self.require_checksums = require_checksums
        self._checksums: dict[str, dict | None] = {}
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def file_checksums(self, relative_path: str) -> dict | None:
        if relative_path not in self._checksums:
            sidecar = Path(self.path) / f"{relative_path}{CHECKSUM_SUFFIX}"
            if sidecar.is_file():
                try:
                    self._checksums[relative_path] = json.loads(sidecar.read_text())
                except ValueError as exc:
                    raise DamagedCheckpointError(f"checksum file {sidecar} is corrupt: {exc}") from None
            elif self.require_checksums:
                raise DamagedCheckpointError(f"checksum file {sidecar} is missing")
            else:
                self._checksums[relative_path] = None  # a foreign DCP folder: nothing to check against
        return self._checksums[relative_path]

    def _slice_file(self, file, sinfo):
        checksums = self.file_checksums(sinfo.relative_path)
        if checksums is None:
            return super()._slice_file(file, sinfo)
        expected = checksums.get(str(sinfo.offset))
        if expected is None:
            raise DamagedCheckpointError(
                f"checkpoint shard {Path(self.path) / sinfo.relative_path}: no checksum "
                f"recorded for the item at offset {sinfo.offset}"
            )
        # checked in bounded pieces, then read again (from the page cache) by DCP: memory stays one item
        if crc32_of_range(file, sinfo.offset, sinfo.length) != expected["crc32"]:  # a short file changes it too
            raise DamagedCheckpointError(
                f"checkpoint shard {Path(self.path) / sinfo.relative_path} is corrupt: the "
                f"bytes of {expected['key']} (offset {sinfo.offset}, {sinfo.length} bytes) "
                f"do not match their CRC32"
            )
        return super()._slice_file(file, sinfo)


# -- finding and checking checkpoints ----------------------------------------------------------


def read_marker(path: Path) -> dict:
    """The COMPLETE marker of `path` ({} if absent or unreadable)."""
    try:
        marker = json.loads((Path(path) / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def read_checked_metadata(path: Path, require_complete: bool = True) -> Metadata:
    """The DCP metadata of `path`, after checking every file it references is present and long enough
    (and has its CRC32 list, where the COMPLETE marker says they were written)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder (a DCP checkpoint is a step-<N>/ folder)")
    if not (path / ".metadata").is_file():
        raise DamagedCheckpointError(f"{path} is not a DCP checkpoint: {path / '.metadata'} is missing")
    if require_complete and not (path / COMPLETE_MARKER).is_file():
        raise DamagedCheckpointError(f"{path} is incomplete (no {COMPLETE_MARKER} marker): its save was interrupted")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata fails to unpickle
        raise DamagedCheckpointError(f"{path / '.metadata'} is corrupt: {exc}") from None
    items_by_file: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        items_by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    checksummed = bool(read_marker(path).get("checksums"))
    for name, items in sorted(items_by_file.items()):
        file = path / name
        sidecar = path / f"{name}{CHECKSUM_SUFFIX}"
        if checksummed and not sidecar.is_file():
            raise DamagedCheckpointError(f"checksum file {sidecar} is missing")
        if not file.is_file():
            raise DamagedCheckpointError(
                f"checkpoint shard {file} is missing (it holds {items[0][2]} and {len(items) - 1} more items)"
            )
        size = file.stat().st_size
        beyond_end = sorted(item for item in items if item[0] + item[1] > size)
        if beyond_end:
            offset, length, key = beyond_end[0]
            raise DamagedCheckpointError(
                f"checkpoint shard {file} is truncated: it has {size} bytes, but {key} is "
                f"stored at bytes {offset}..{offset + length}"
            )
    return metadata


def stored_shapes(metadata: Metadata) -> dict[str, tuple | None]:
    """Flattened key -> shape of every stored entry (None for a non-tensor one)."""
    return {
        key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
        for key, entry in metadata.state_dict_metadata.items()
    }


def failures_text(exc: CheckpointException) -> str:
    """One line per failed rank: the exception, without DCP's traceback."""
    failures = sorted(exc.failures.items())
    return "; ".join(f"rank {rank}: {type(error).__name__}: {error}" for rank, (error, _) in failures)


def load_verified(path: Path, template: dict, require_checksums: bool, **load_options) -> None:
    """dcp.load `path` into `template` in place, checking each item's CRC32 where one was recorded."""
    _load(VerifyingReader(path, require_checksums), template, path, **load_options)


def _load(reader: VerifyingReader, template: dict, path: Path, **load_options) -> None:
    try:
        dcp.load(template, storage_reader=reader, **load_options)
    except CheckpointException as exc:
        for _, (error, _) in sorted(exc.failures.items()):
            if isinstance(error, CheckpointError):
                raise type(error)(str(error)) from None
        raise CheckpointError(f"loading checkpoint {path} failed: {failures_text(exc)}") from None


# -- reading without a process group -------------------------------------------------------------


class DcpCheckpoint:
    """A checked DCP step folder read in one process: tensors as SourceTensors, other entries as objects.

    Every read goes through `dcp.load` of a partial state dict, so chunks saved by any number of
    ranks are assembled by DCP and checked by `VerifyingReader`. CRC32 lists are required where the
    COMPLETE marker says they were written; a foreign folder without them is read unchecked.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.metadata: Metadata = read_checked_metadata(self.folder)
        self.complete = read_marker(self.folder)
        if not isinstance(getattr(self.metadata, "planner_data", None), dict):
            raise CheckpointError(
                f"{self.folder}/.metadata has no key paths (planner_data): not saved with DCP's default planner"
            )
        self._reader = VerifyingReader(self.folder, require_checksums=bool(self.complete.get("checksums")))

    def paths(self, *prefix: str | int) -> dict[str, tuple]:
        """Flattened key -> path tuple of the entries under `prefix`, in the order they were saved."""
        return {key: path for key, path in self.metadata.planner_data.items() if path[: len(prefix)] == prefix}

    def has(self, *prefix: str | int) -> bool:
        return bool(self.paths(*prefix))

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata[key], TensorStorageMetadata)

    def load(self, state: dict[str, Any]) -> dict[str, Any]:
        """dcp.load the flattened keys of `state` (tensors filled in place, objects replaced); returns it."""
        with warnings.catch_warnings():  # one process by design: not worth a warning per tensor
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load(self._reader, state, self.folder, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return state

    def tensor(self, key: str) -> SourceTensor:
        """The tensor saved under flattened `key`, read when asked (all its chunks, from every rank's file)."""
        entry = self.metadata.state_dict_metadata[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{key} in {self.folder} is not a tensor")
        shape = tuple(entry.size)

        def fill(out: torch.Tensor, start: int) -> None:
            whole = out if tuple(out.shape) == shape else torch.empty(shape, dtype=out.dtype)
            self.load({key: whole})
            if whole is not out:
                out.copy_(whole[start : start + out.shape[0]])

        return SourceTensor(key, shape, entry.properties.dtype, fill)

    def nested(self, *prefix: str, read_tensors: bool = False) -> Any:
        """The structure saved under `prefix`: tensors as SourceTensors (or read, with `read_tensors`), the rest loaded.

        Path elements that are ints are list indices (DCP flattens lists of dicts that way).
        """
        paths = self.paths(*prefix)
        objects = {key: None for key in paths if not self.is_tensor(key)}
        if objects:
            self.load(objects)
        root: dict = {}
        for key, path in paths.items():
            node = root
            for part in path[len(prefix) : -1]:
                node = node.setdefault(part, {})
            if self.is_tensor(key):
                node[path[-1]] = self.tensor(key).read() if read_tensors else self.tensor(key)
            else:
                node[path[-1]] = objects[key]
        return _lists_from_int_keys(root)


def _lists_from_int_keys(node: Any) -> Any:
    """Dicts whose keys are exactly 0..n-1 (ints) were lists before DCP flattened them."""
    if not isinstance(node, dict):
        return node
    converted = {key: _lists_from_int_keys(value) for key, value in node.items()}
    indices = list(range(len(converted)))
    if converted and all(isinstance(key, int) for key in converted) and sorted(converted) == indices:
        return [converted[i] for i in indices]
    return converted
