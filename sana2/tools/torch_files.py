"""Read and write torch.save's zip format one tensor at a time.

`torch.save` pickles the object first (`data.pkl`, tensors reduced to references to storage
records) and then writes each storage as a record `data/<key>`; `torch.load` reads them back.
Both hold every tensor in memory at once. Here:

- `TorchArchive` unpickles `data.pkl` into `StoredTensor`s (shape, dtype, where the bytes are)
  without reading any tensor data, so a caller reads one tensor at a time, straight into its
  own buffer. The unpickler resolves only tensor-rebuilding globals; anything else in the file
  becomes an inert `Opaque` placeholder, so no code from the file runs.
- `TorchSaveStream` writes `data.pkl` for an object whose tensors are `TensorSlot`s (shape and
  dtype known in advance), then one record per `write()`: a file `torch.load` (weights_only,
  mmap) reads exactly like a `torch.save` output, written with one tensor in memory.
- `ScratchBuffer` gives those one-at-a-time tensors one reused allocation.
"""

import contextlib
import ctypes
import io
import os
import pickle
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

# The legacy storage class torch.save names for each dtype (what `torch.load` looks the dtype up by).
STORAGE_CLASS_NAMES = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}
STORAGE_CLASSES = {name: getattr(torch, name) for name in STORAGE_CLASS_NAMES.values()}
STORAGE_DTYPES = {name: dtype for dtype, name in STORAGE_CLASS_NAMES.items()}
PICKLE_PROTOCOL = 2  # torch.save's default


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable and without a copy (any dtype, bf16 included).

    (Through ctypes rather than .numpy(): sharing with numpy would pin the storage's size.)
    """
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def read_exactly(file: BinaryIO, offset: int, buffer: memoryview) -> None:
    """Fill `buffer` from `file` at `offset`; a short read means the file is truncated."""
    done = 0
    while done < len(buffer):
        count = os.preadv(file.fileno(), [buffer[done:]], offset + done)
        if count == 0:
            raise EOFError(f"{file.name}: file ends at byte {offset + done}, expected {offset + len(buffer)}")
        done += count


class ScratchBuffer:
    """One allocation reused by tensors read one after another.

    Allocating and freeing a fresh tensor per read makes the C allocator keep freed blocks
    around, and resident memory then creeps well past the largest tensor; reusing one buffer
    keeps it at the largest tensor. A tensor it returns is valid until the next call.
    """

    def __init__(self):
        self.memory = torch.empty(0, dtype=torch.uint8)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.memory.numel():
            self.memory = torch.empty(0, dtype=torch.uint8)  # release the old one before allocating
            self.memory = torch.empty(nbytes, dtype=torch.uint8)
        return self.memory[:nbytes].view(dtype).view(shape)


class _FileSlice(io.RawIOBase):
    """A read-only window [offset, offset + length) of an open file, as a file of its own."""

    def __init__(self, file: BinaryIO, offset: int, length: int):
        super().__init__()
        self.file, self.offset, self.length, self.position = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + position
        return self.position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        count = max(0, min(len(view), self.length - self.position))
        read_exactly(self.file, self.offset + self.position, view[:count])
        self.position += count
        return count


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside a torch.save file: its metadata, and where its storage's bytes are."""

    archive: "TorchArchive" = field(repr=False)
    record: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_numel: int

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def read_into(self, out: torch.Tensor) -> None:
        """Copy this tensor into `out` (contiguous, same shape and dtype)."""
        self.read_rows_into(0, out)

    def read_rows_into(self, start: int, out: torch.Tensor) -> None:
        """Copy rows [start, start + len(out)) of dim 0 into `out` (contiguous); all of a 0-dim tensor.

        A contiguous tensor's rows are one byte range, read on their own.
        """
        row_numel = torch.Size(self.shape[1:]).numel() if self.shape else 0
        first = self.storage_offset + start * row_numel
        if self.stride == contiguous_strides(self.shape) or (start == 0 and out.numel() <= 1):
            if first + out.numel() > self.storage_numel:
                raise ValueError(
                    f"{self.record}: {out.numel()} elements at offset {first} do not fit "
                    f"its storage of {self.storage_numel} elements"
                )
            offset = self.archive.record_file_offset(self.record) + first * self.dtype.itemsize
            read_exactly(self.archive.file, offset, as_bytes(out))
        else:  # a strided view: read its whole storage, then gather
            storage = torch.empty(self.storage_numel, dtype=self.dtype)
            read_exactly(self.archive.file, self.archive.record_file_offset(self.record), as_bytes(storage))
            full = storage.as_strided(self.shape, self.stride, self.storage_offset)
            out.copy_(full[start : start + out.shape[0]] if self.shape else full)

    def read(self, buffer: "ScratchBuffer | None" = None) -> torch.Tensor:
        """The tensor, in fresh memory or in `buffer`'s (then valid until the buffer's next use)."""
        if buffer is not None:
            out = buffer.tensor(self.shape, self.dtype)
        else:
            out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


class Opaque:
    """Stands in for an object of any class the lazy unpickler does not resolve: none of that class's code runs."""

    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass

    def __repr__(self) -> str:
        return f"<opaque {self.qualified_name}>"


def _opaque_class(module: str, name: str) -> type:
    return type("Opaque", (Opaque,), {"qualified_name": f"{module}.{name}"})


@dataclass(frozen=True)
class _StorageRef:
    record: str
    dtype: torch.dtype
    numel: int


class _LazyUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: "TorchArchive"):
        super().__init__(io.BytesIO(data))
        self.archive = archive

    def find_class(self, module: str, name: str):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch._utils" and name == "_rebuild_parameter":
            return lambda data, requires_grad, hooks: data
        if module == "torch._utils" and name == "_rebuild_parameter_with_state":
            return lambda data, requires_grad, hooks, state: data
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch" and name in STORAGE_CLASSES:
            return STORAGE_CLASSES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch" and name == "Size":
            return torch.Size
        return _opaque_class(module, name)

    def persistent_load(self, pid):
        _, storage_class, key, _location, numel = pid
        # (by name: asking a legacy storage class for its dtype warns that TypedStorage is deprecated)
        dtype = STORAGE_DTYPES.get(storage_class.__name__, torch.uint8)
        return _StorageRef(f"data/{key}", dtype, numel)

    def _rebuild_tensor(
        self, storage: _StorageRef, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None
    ) -> StoredTensor:
        return StoredTensor(
            self.archive, storage.record, storage.dtype, tuple(size), tuple(stride), storage_offset, storage.numel
        )


class TorchArchive:
    """A torch.save file (or a window of a file holding one, as DCP's .distcp shards do).

    `root` is the saved object with every tensor replaced by a `StoredTensor`.
    """

    def __init__(self, file: BinaryIO, offset: int = 0, length: int | None = None):
        self.file = file
        self.offset = offset
        if length is None:
            length = os.fstat(file.fileno()).st_size - offset
        self.reader = torch._C.PyTorchFileReader(_FileSlice(file, offset, length))
        self.root = _LazyUnpickler(bytes(self.reader.get_record("data.pkl")), self).load()

    @classmethod
    def open(cls, path: str | os.PathLike) -> "TorchArchive":
        return cls(open(path, "rb"))

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record_file_offset(self, record: str) -> int:
        return self.offset + self.reader.get_record_offset(record)


@dataclass(frozen=True)
class TensorSlot:
    """A tensor to be written later: its shape and dtype, and whatever tells the caller where it comes from."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Any = None


@dataclass(frozen=True)
class _PendingStorage:
    key: str
    slot: TensorSlot


class TorchSaveStream:
    """Write `obj` (tensors given as `TensorSlot`s) as torch.save would, tensor data supplied one at a time.

    After construction `slots` lists the slots in the order `write()` must receive their tensors.
    Use it as a context manager: it closes the file on success and abandons it on an error.
    """

    def __init__(self, path: str | os.PathLike, obj: Any):
        self.path = str(path)
        self.slots: list[TensorSlot] = []
        data = self._pickle(obj)
        self.written = 0
        try:
            self.writer = torch._C.PyTorchFileWriter(self.path)
        except RuntimeError as exc:
            raise OSError(f"cannot create {self.path}: {str(exc).splitlines()[0]}") from None
        with self._write_errors():
            self.writer.write_record("data.pkl", data, len(data))
            for name, value in ((".format_version", "1"), (".storage_alignment", "64"), ("byteorder", sys.byteorder)):
                self.writer.write_record(name, value, len(value))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abandon()
        return False

    @contextlib.contextmanager
    def _write_errors(self):
        """The C++ writer reports a failed write (a full disk) as RuntimeError: make it an OSError."""
        try:
            yield
        except RuntimeError as exc:
            self.abandon()
            raise OSError(f"writing {self.path} failed: {str(exc).splitlines()[0]}") from None

    def abandon(self) -> None:
        """Finish the writer now, ignoring errors: the caller deletes the file.

        An unfinished writer finishes the file when it is destroyed; if that write fails too (a full
        disk), the error escapes a C++ destructor and aborts the process. Finishing marks it done
        even when finishing fails.
        """
        try:
            self.writer.write_end_of_file()
        except RuntimeError:
            pass

    def _pickle(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        stream = self

        class SlotPickler(pickle.Pickler):
            def persistent_id(self, value):
                if isinstance(value, _PendingStorage):
                    numel = torch.Size(value.slot.shape).numel()
                    return ("storage", STORAGE_CLASSES[STORAGE_CLASS_NAMES[value.slot.dtype]], value.key, "cpu", numel)
                return None

            def reducer_override(self, value):
                if not isinstance(value, TensorSlot):
                    return NotImplemented
                storage = _PendingStorage(str(len(stream.slots)), value)
                stream.slots.append(value)
                args = (storage, 0, tuple(value.shape), contiguous_strides(tuple(value.shape)), False, OrderedDict())
                return torch._utils._rebuild_tensor_v2, args

        SlotPickler(buffer, protocol=PICKLE_PROTOCOL).dump(obj)
        return buffer.getvalue()

    def write(self, tensor: torch.Tensor) -> None:
        slot = self.slots[self.written]
        if tuple(tensor.shape) != tuple(slot.shape) or tensor.dtype != slot.dtype:
            raise ValueError(
                f"tensor {slot.source!r}: got {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {tuple(slot.shape)} {slot.dtype}"
            )
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        start = tensor.storage_offset() * tensor.element_size()
        storage = tensor.untyped_storage()[start : start + nbytes]  # shares memory: no copy
        with self._write_errors():
            self.writer.write_record(f"data/{self.written}", storage, nbytes)
        self.written += 1

    def close(self) -> None:
        if self.written != len(self.slots):
            raise ValueError(f"{len(self.slots) - self.written} tensors were never written")
        with self._write_errors():
            self.writer.write_end_of_file()


def save_streamed(path: str | os.PathLike, obj: Any, load_tensor) -> None:
    """torch.save-compatible file for `obj`, loading each TensorSlot's data with `load_tensor(slot)`."""
    with TorchSaveStream(path, obj) as stream:
        for slot in stream.slots:
            stream.write(load_tensor(slot))
