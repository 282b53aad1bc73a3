"""Count the bytes of live tensor storage, exactly, on any device: the measuring instrument of the plan.

`LiveBytes` is a `TorchDispatchMode`: every aten op run under it (forward, backward, optimizer,
FSDP's copies) reports its outputs, and each output storage not seen before is added to the running
total until Python frees it (a weakref finalizer on the storage). Views share their storage and are
counted once. FSDP frees and re-allocates unsharded parameters by resizing their storages, which no
op reports, so `UntypedStorage.resize_` is wrapped while the mode is active. Storages that existed
before (parameters, inputs) can be declared `known`: they count from zero, so only what the measured
code allocates (or frees by resizing) is counted. With `meta=True` it counts meta tensors too: code run
on the meta device allocates nothing, but its live tensor bytes are those of the real run (how the plan
measures a VAE's encode from its config alone, sana2/planning/vae_encode.py).

Why this and not something else: CPU RSS mixes in the allocator's caching and the runtime;
`torch.cuda.max_memory_allocated` exists only on CUDA; the profiler's CPU memory events lose the
order of allocations inside an op; torch's `MemTracker` (torch.distributed._tools) is private. A
dispatch mode is the documented way to see every op's outputs ("Extending all torch API with
Modes" in PyTorch's extending notes).
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """`with LiveBytes(known=tensors) as live:` ... then `live.current` and `live.peak`, in bytes."""

    def __init__(self, known=(), meta: bool = False):
        super().__init__()
        self.meta = meta
        self.current = 0
        self.peak = 0
        self._counted: dict[int, int] = {}  # id(storage) -> bytes it adds to `current`
        self._resize = None
        for tensor in known:
            self._track(tensor.untyped_storage(), 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track(self, storage, nbytes: int) -> None:
        self._counted[id(storage)] = nbytes
        weakref.finalize(storage, self._release, id(storage))
        self._add(nbytes)

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        self.current -= self._counted.pop(key, 0)

    def _saw(self, storage) -> None:
        if id(storage) not in self._counted and (self.meta or storage.device.type != "meta"):
            self._track(storage, storage.nbytes())

    def __enter__(self):
        original = self._resize = torch.UntypedStorage.resize_
        live = self

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            if live.meta or storage.device.type != "meta":
                if id(storage) not in live._counted:
                    live._track(storage, before)
                live._counted[id(storage)] += storage.nbytes() - before
                live._add(storage.nbytes() - before)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                for plain in _plain_tensors(tensor):
                    self._saw(plain.untyped_storage())
        return out


def _plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own storage: a DTensor's local shard, not the wrapper (which has none)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = (getattr(tensor, name) for name in names)
    return [plain for t in inner if isinstance(t, torch.Tensor) for plain in _plain_tensors(t)]
