"""Read a sana2 training checkpoint (a DCP folder) one full tensor at a time, without a process group.

`.metadata` is read once. It lists every flattened key (`model.blocks.0.attn.qkv.weight`,
`optimizer.state.<fqn>.exp_avg`, `train_state.step`, ...), each tensor's full shape and dtype,
and for each saved chunk the shard file, byte offset and length of a small torch.save archive
holding it. A full tensor is assembled by reading each chunk's bytes straight into its rows of
one output buffer (FSDP2 shards dim 0, so a chunk is a contiguous range of the full tensor);
other chunk shapes are copied in through a temporary.
"""

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from sana2.components.checkpoint import CheckpointError, read_checked_metadata, read_marker
from sana2.tools.torch_files import ScratchBuffer, StoredTensor, TorchArchive, read_exactly


def _is_row_range(offsets, sizes, full_shape) -> bool:
    """Whether a chunk is a contiguous block of the full tensor's memory (a range of dim-0 rows)."""
    return all(o == 0 and s == f for o, s, f in zip(offsets[1:], sizes[1:], full_shape[1:]))


class DcpCheckpoint:
    """A validated DCP step folder: `<dump>/checkpoint/step-<N>/` with `.metadata`, shards and COMPLETE."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        # the trainer's own checks: folder, .metadata, COMPLETE, every shard present and long enough
        self.metadata: Metadata = read_checked_metadata(self.folder)
        self.complete = read_marker(self.folder)
        if not isinstance(getattr(self.metadata, "planner_data", None), dict):
            raise CheckpointError(f"{self.folder}/.metadata has no key paths (planner_data): "
                                  "not saved with DCP's default planner")
        for info in self.metadata.storage_data.values():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{self.folder / info.relative_path}: stream transforms "
                                      f"{info.transform_descriptors} are not supported")
        self._files: dict[str, Any] = {}
        # (flattened key, chunk offsets or None for an object) -> where its bytes are
        self._storage_by_key = {(index.fqn, None if index.offset is None else tuple(index.offset)): info
                                for index, info in self.metadata.storage_data.items()}

    # -- keys -------------------------------------------------------------------------------------
    def paths(self, *prefix: str | int) -> dict[str, tuple]:
        """Flattened key -> path tuple for the entries under `prefix`, in the order they were saved."""
        return {key: path for key, path in self.metadata.planner_data.items() if path[:len(prefix)] == prefix}

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
        try:
            archive = TorchArchive(self._file(info.relative_path), info.offset, info.length)
        except Exception as exc:
            raise CheckpointError(f"shard file {self.folder / info.relative_path} is damaged at byte "
                                  f"{info.offset} ({key}): {exc}") from None
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
                raise CheckpointError(f"{key}: stored chunk is {tuple(stored.shape)} {stored.dtype}, "
                                      f"the metadata says {tuple(chunk.sizes)} {full.dtype}")
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
            _set_path(root, path[len(prefix):], value)
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

