"""Read a sana2 training checkpoint (a DCP folder) one full tensor at a time, without a process group.

`.metadata` is read once. It lists every flattened key (`model.blocks.0.attn.qkv.weight`,
`optimizer.state.<fqn>.exp_avg`, `train_state.step`, ...), each tensor's full shape and dtype,
and for each saved chunk the shard file, byte offset and length of a small torch.save archive
holding it. A full tensor is assembled by reading each chunk's bytes straight into its rows of
one output buffer (FSDP2 shards dim 0, so a chunk is a contiguous range of the full tensor);
other chunk shapes are copied in through a temporary.

Where the trainer wrote a CRC32 list beside a data file (`__<rank>_0.distcp.crc32.json`), every
item's bytes are checked against it before they are used, as the trainer's own loads do: a flipped
byte stops the conversion with the shard file and the key instead of being exported. A folder
without the lists (a foreign DCP folder) is read unchecked, unless its COMPLETE marker says the
lists were written: then a missing one is an error.
"""

import io
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from sana2.components.checkpoint import (
    CheckpointError,
    VerifyingReader,
    crc32_of_range,
    read_checked_metadata,
    read_marker,
)
from sana2.tools.torch_files import ScratchBuffer, StoredTensor, TorchArchive, read_exactly


def _is_row_range(offsets, sizes, full_shape) -> bool:
    """Whether a chunk is a contiguous block of the full tensor's memory (a range of dim-0 rows)."""
    return all(o == 0 and s == f for o, s, f in zip(offsets[1:], sizes[1:], full_shape[1:]))


class _ItemChecksums:
    """Checks a DCP item's bytes against the CRC32 list the trainer wrote beside its data file.

    The lists are found and parsed by the checkpoint component's own VerifyingReader (one reader
    of that format); the messages are the ones its loads give. (A candidate for a public helper
    in sana2/components/checkpoint.py that VerifyingReader would use too.)
    """

    def __init__(self, folder: Path, required: bool):
        self.folder = folder
        self._lists = VerifyingReader(folder, require_checksums=required)

    def _expected(self, info) -> dict | None:
        checksums = self._lists.file_checksums(info.relative_path)
        if checksums is None:
            return None  # no list for this file, and none required: read unchecked
        expected = checksums.get(str(info.offset))
        if expected is None:
            raise CheckpointError(
                f"checkpoint shard {self.folder / info.relative_path}: no checksum "
                f"recorded for the item at offset {info.offset}"
            )
        return expected

    def _compare(self, info, expected: dict, crc: int, length: int) -> None:
        if length != info.length or crc != expected.get("crc32"):
            raise CheckpointError(
                f"checkpoint shard {self.folder / info.relative_path} is corrupt: the "
                f"bytes of {expected.get('key')} (offset {info.offset}, {info.length} bytes) "
                f"do not match their CRC32"
            )

    def check_range(self, file, info) -> None:
        """Read the item's bytes from `file` in bounded pieces and check them (nothing if unlisted).

        (Its bytes are then read again to be used, from the page cache: memory stays one tensor.)
        """
        expected = self._expected(info)
        if expected is None:
            return
        # a short read (a file shorter than the metadata says) gives another CRC: reported as corrupt
        self._compare(info, expected, crc32_of_range(file, info.offset, info.length), info.length)

    def check_bytes(self, info, data) -> None:
        """Check the item's bytes already read into `data`."""
        expected = self._expected(info)
        if expected is not None:
            self._compare(info, expected, zlib.crc32(data), len(data))


class DcpCheckpoint:
    """A validated DCP step folder: `<dump>/checkpoint/step-<N>/` with `.metadata`, shards and COMPLETE."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        # the trainer's own checks: folder, .metadata, COMPLETE, every shard present and long enough
        self.metadata: Metadata = read_checked_metadata(self.folder)
        self.complete = read_marker(self.folder)
        if not isinstance(getattr(self.metadata, "planner_data", None), dict):
            raise CheckpointError(
                f"{self.folder}/.metadata has no key paths (planner_data): not saved with DCP's default planner"
            )
        for info in self.metadata.storage_data.values():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{self.folder / info.relative_path}: stream transforms "
                    f"{info.transform_descriptors} are not supported"
                )
        self._files: dict[str, Any] = {}
        self._checksums = _ItemChecksums(self.folder, required=bool(self.complete.get("checksums")))
        # (flattened key, chunk offsets or None for an object) -> where its bytes are
        self._storage_by_key = {
            (index.fqn, None if index.offset is None else tuple(index.offset)): info
            for index, info in self.metadata.storage_data.items()
        }

    # -- keys -------------------------------------------------------------------------------------
    def paths(self, *prefix: str | int) -> dict[str, tuple]:
        """Flattened key -> path tuple for the entries under `prefix`, in the order they were saved."""
        return {key: path for key, path in self.metadata.planner_data.items() if path[: len(prefix)] == prefix}

    def has(self, *prefix: str | int) -> bool:
        return bool(self.paths(*prefix))

    def tensor_metadata(self, key: str) -> TensorStorageMetadata:
        entry = self.metadata.state_dict_metadata[key]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{key} in {self.folder} is not a tensor")
        return entry

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata[key], TensorStorageMetadata)

    # -- reading ----------------------------------------------------------------------------------
    def _file(self, relative_path: str):
        if relative_path not in self._files:
            self._files[relative_path] = open(self.folder / relative_path, "rb")
        return self._files[relative_path]

    def _chunk(self, key: str, offsets) -> StoredTensor:
        info = self._storage_by_key[(key, tuple(offsets))]
        self._checksums.check_range(self._file(info.relative_path), info)  # before anything is parsed
        try:
            archive = TorchArchive(self._file(info.relative_path), info.offset, info.length)
        except Exception as exc:
            raise CheckpointError(
                f"shard file {self.folder / info.relative_path} is damaged at byte {info.offset} ({key}): {exc}"
            ) from None
        if not isinstance(archive.root, StoredTensor):
            raise CheckpointError(f"{key} in {self.folder / info.relative_path} does not hold a tensor")
        return archive.root

    def read_tensor(self, key: str, buffer: ScratchBuffer | None = None) -> torch.Tensor:
        """The full tensor saved under flattened `key`, assembled from all its chunks.

        With `buffer`, the tensor lives in the buffer's memory (valid until its next use).
        """
        entry = self.tensor_metadata(key)
        shape, dtype = tuple(entry.size), entry.properties.dtype
        full = buffer.tensor(shape, dtype) if buffer is not None else torch.empty(shape, dtype=dtype)
        covered = 0
        for chunk in entry.chunks:
            stored = self._chunk(key, chunk.offsets)
            if tuple(stored.shape) != tuple(chunk.sizes) or stored.dtype != full.dtype:
                raise CheckpointError(
                    f"{key}: stored chunk is {tuple(stored.shape)} {stored.dtype}, "
                    f"the metadata says {tuple(chunk.sizes)} {full.dtype}"
                )
            try:
                self._read_chunk(stored, full, chunk.offsets, chunk.sizes)
            except EOFError as exc:
                raise CheckpointError(f"shard file is truncated: {exc}") from None
            covered += torch.Size(chunk.sizes).numel()
        if covered != full.numel():
            raise CheckpointError(f"{key}: the saved chunks cover {covered} of {full.numel()} elements")
        return full

    @staticmethod
    def _read_chunk(stored: StoredTensor, full: torch.Tensor, offsets, sizes) -> None:
        if full.dim() == 0:
            stored.read_into(full)
        elif _is_row_range(offsets, sizes, full.shape):
            rows = full.narrow(0, offsets[0], sizes[0])  # contiguous: read straight into it
            stored.read_into(rows)
        else:
            region = full
            for dim, (offset, size) in enumerate(zip(offsets, sizes)):
                region = region.narrow(dim, offset, size)
            region.copy_(stored.read())

    def read_object(self, key: str) -> Any:
        """A non-tensor entry (ints, lists, RNG states ...), as DCP saved it with torch.save."""
        if not isinstance(self.metadata.state_dict_metadata[key], BytesStorageMetadata):
            raise CheckpointError(f"{key} in {self.folder} is not a plain object")
        info = self._storage_by_key[(key, None)]
        data = bytearray(info.length)
        try:
            read_exactly(self._file(info.relative_path), info.offset, memoryview(data))
        except EOFError as exc:
            raise CheckpointError(f"shard file is truncated: {exc}") from None
        self._checksums.check_bytes(info, data)
        # weights_only=False as DCP's own loader: RNG states hold numpy arrays; the checkpoint is trusted
        return torch.load(io.BytesIO(data), weights_only=False)

    def nested(self, *prefix: str, tensor_leaf=None) -> Any:
        """The sub-structure saved under `prefix`: objects loaded, tensors as `tensor_leaf(key, metadata)`.

        Path elements that are ints are list indices (DCP flattens lists of dicts that way).
        """
        root: dict = {}
        for key, path in self.paths(*prefix).items():
            if self.is_tensor(key):
                value = tensor_leaf(key, self.tensor_metadata(key)) if tensor_leaf else self.read_tensor(key)
            else:
                value = self.read_object(key)
            _set_path(root, path[len(prefix) :], value)
        return _lists_from_int_keys(root)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _set_path(root: dict, path: tuple, value: Any) -> None:
    node = root
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _lists_from_int_keys(node: Any) -> Any:
    """Dicts whose keys are exactly 0..n-1 (ints) were lists before DCP flattened them."""
    if not isinstance(node, dict):
        return node
    converted = {key: _lists_from_int_keys(value) for key, value in node.items()}
    if converted and all(isinstance(key, int) for key in converted):
        if sorted(converted) == list(range(len(converted))):
            return [converted[i] for i in range(len(converted))]
    return converted
