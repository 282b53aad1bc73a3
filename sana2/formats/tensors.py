"""The one description of a tensor in a checkpoint file, and the one report of keys and shapes that differ.

A `SourceTensor` is a tensor that has not been read yet: its name, shape and dtype, and a `fill`
function that copies it (or a range of its dim-0 rows) into a tensor the caller provides. Readers
(torch files, safetensors, DCP folders) hand out SourceTensors; writers take them and read each one
when its turn comes, so a checkpoint of any size passes through memory one tensor at a time. An
output format is an ordered list of SourceTensors named by their output keys: renaming, casting and
other transforms make new SourceTensors from old ones without reading anything.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or written; the message names the folder or file and the key."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, short or corrupt (rather than one that does not fit the run)."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type), for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """A tensor read on demand.

    `fill(out, start)` copies rows [start, start + out.shape[0]) of dim 0 (the whole tensor when it
    is 0-dim) into `out`, converting to `out.dtype` as `Tensor.copy_` does. So `dtype` may differ
    from what is stored: a cast costs nothing until the read.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Callable[[torch.Tensor, int], None] = dataclasses.field(repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill `out` (this tensor's shape, or fewer dim-0 rows from `start`) and return it."""
        if self.shape:
            fits = tuple(out.shape[1:]) == self.shape[1:] and 0 <= start and start + out.shape[0] <= self.shape[0]
        else:
            fits = out.dim() == 0 and start == 0
        if not fits:
            raise ValueError(f"{self.name}: cannot read {tuple(out.shape)} at row {start} of {self.shape}")
        if out.numel():  # an empty shard (a rank given no rows) reads nothing
            self.fill(out, start)
        return out

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows [start, stop) of dim 0 (all of them by default) in fresh memory."""
        if not self.shape:
            return self.read_into(torch.empty((), dtype=self.dtype))
        stop = self.shape[0] if stop is None else stop
        return self.read_into(torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype), start)

    def read_bytes(self, buffer: torch.Tensor):
        """This tensor's bytes (a numpy uint8 view), read into the front of `buffer`, a uint8 tensor of nbytes or more.

        Writers reuse one buffer for every tensor: a fresh allocation each time would fault in new pages.
        """
        raw = buffer[: self.nbytes]
        self.read_into(raw.view(self.dtype).view(self.shape))
        return raw.numpy()

    def renamed(self, name: str) -> "SourceTensor":
        return dataclasses.replace(self, name=name)

    def to(self, dtype: torch.dtype) -> "SourceTensor":
        """This tensor read as `dtype` (floating-point tensors only; others keep their dtype)."""
        return dataclasses.replace(self, dtype=dtype if self.dtype.is_floating_point else self.dtype)

    def transformed(
        self, fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, name: str = ""
    ) -> "SourceTensor":
        """`fn` of this tensor, whose result has `shape` and `dtype` (read whole, then transformed)."""

        def fill(out: torch.Tensor, start: int) -> None:
            result = fn(self.read())
            if tuple(result.shape) != tuple(shape):
                raise ValueError(f"{name or self.name}: transform gave {tuple(result.shape)}, expected {shape}")
            out.copy_(result[start : start + out.shape[0]] if shape else result)

        return SourceTensor(name or self.name, tuple(shape), dtype, fill)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "SourceTensor":
        """A tensor already in memory."""

        def fill(out: torch.Tensor, start: int) -> None:
            out.copy_(tensor[start : start + out.shape[0]] if tensor.dim() else tensor)

        return cls(name, tuple(tensor.shape), tensor.dtype, fill)


def map_tensors(obj: Any, fn: Callable[[Any, tuple], Any], path: tuple = ()) -> Any:
    """`obj` with every tensor or SourceTensor leaf replaced by `fn(leaf, path)` (dicts, lists, tuples walked).

    `path` is the leaf's keys and indices from the root. Leaves are visited in a fixed order (dict
    insertion order), so two walks of structures built the same way meet their leaves in the same order.
    """
    if isinstance(obj, (torch.Tensor, SourceTensor)):
        return fn(obj, path)
    if isinstance(obj, Mapping):
        return type(obj)((key, map_tensors(value, fn, (*path, key))) for key, value in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):  # not a namedtuple
        return type(obj)(map_tensors(value, fn, (*path, index)) for index, value in enumerate(obj))
    return obj


def tensor_leaves(obj: Any) -> list:
    """The tensor or SourceTensor leaves of `obj`, in map_tensors' order."""
    leaves: list = []
    map_tensors(obj, lambda leaf, path: leaves.append(leaf))
    return leaves


MAX_PROBLEMS_SHOWN = 10


def check_shapes(
    where: str,
    stored: Mapping[str, tuple | None],
    needed: Mapping[str, tuple | None],
    unexpected: Callable[[str], bool] = lambda key: True,
) -> None:
    """The one key and shape comparison: raise a CheckpointError listing every mismatch, or return.

    `stored` and `needed` map keys to shapes (None for a non-tensor entry, whose shape is not
    compared). A stored key that is not needed is a problem where `unexpected(key)` says so.
    """
    problems = [f"{key} is missing" for key in needed if key not in stored]
    problems += [
        f"{key} has shape {stored[key]}, this run needs {shape}"
        for key, shape in needed.items()
        if key in stored and None not in (shape, stored[key]) and tuple(stored[key]) != tuple(shape)
    ]
    problems += [
        f"{key} is stored but this model has no such tensor" for key in stored if key not in needed and unexpected(key)
    ]
    if problems:
        more = len(problems) - MAX_PROBLEMS_SHOWN
        shown = "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        raise CheckpointError(f"{where} does not match this run (another model or options?): {shown}")
