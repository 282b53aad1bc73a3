"""--to-dcp: turn a full single-file model checkpoint into a DCP folder a sharded model can dcp.load.

Accepted inputs: a torch.save file holding {"state_dict": ...} (the reference's .pth), a plain
state dict (Accelerate's pytorch_model_fsdp.bin), or safetensors (a file, or a folder with
model.safetensors or an index and shards). The DCP folder holds "model" and "train_state"
(step 0), plus COMPLETE and config.json, as the trainer writes them.

dcp.save is given meta tensors (shapes and dtypes only) and a planner that reads each tensor
from the input file when the writer asks for it, so one tensor is in memory at a time.
"""

import functools
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from sana2.tools.dcp_source import CheckpointError
from sana2.tools.progress import Progress
from sana2.tools.safetensors_files import INDEX_NAME, SINGLE_NAME, SafetensorsFile, safetensors_files
from sana2.tools.torch_files import ScratchBuffer, StoredTensor, TorchArchive


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the input file; `reader(buffer)` reads it (into fresh memory when buffer is None)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    reader: Callable[[ScratchBuffer | None], torch.Tensor]

    def read(self, buffer: ScratchBuffer | None = None) -> torch.Tensor:
        return self.reader(buffer)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def open_full_checkpoint(path: Path) -> list[SourceTensor]:
    """The model tensors of a single-file checkpoint, in file order, each readable on its own."""
    if path.is_dir() or path.suffix == ".safetensors":
        return _safetensors_tensors(path)
    try:
        archive = TorchArchive(open(path, "rb"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except Exception as exc:  # not a zip, a damaged pickle: one line naming the file
        raise CheckpointError(f"{path} is not a readable torch.save (zip format) file: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    root = archive.root
    state_dict = root.get("state_dict", root) if isinstance(root, dict) else root
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"{path} holds {type(state_dict).__name__}, not a state dict")
    tensors = []
    for name, value in state_dict.items():
        if not isinstance(value, StoredTensor):
            raise CheckpointError(f"{path}: entry {name!r} of the state dict is not a tensor ({value!r})")
        tensors.append(SourceTensor(name, value.shape, value.dtype, value.read))
    return tensors


def _safetensors_tensors(path: Path) -> list[SourceTensor]:
    if path.is_dir() and not ((path / INDEX_NAME).is_file() or (path / SINGLE_NAME).is_file()):
        raise CheckpointError(f"{path} holds neither {SINGLE_NAME} nor {INDEX_NAME}")
    tensors = []
    for file_path in safetensors_files(path):
        if not file_path.is_file():
            raise CheckpointError(f"safetensors file {file_path} is missing")
        try:
            file = SafetensorsFile(file_path)
        except Exception as exc:  # a damaged header: one line naming the file
            raise CheckpointError(f"{file_path} is not a readable safetensors file: {exc}") from None
        for name in file.names():
            entry = file.entry(name)
            tensors.append(SourceTensor(name, entry.shape, entry.dtype, functools.partial(file.read, name)))
    return tensors


def output_dtype(tensor: SourceTensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype


class _ReadOnDemandPlanner(DefaultSavePlanner):
    """Resolves each "model" tensor by reading it from the input file when the writer reaches it.

    FileSystemWriter keeps a reference to every tensor it wrote to a shard file until the file is
    closed (it needs them only for its safetensors mode). With the serial loader, a tensor has
    been written out completely when the next one is resolved, so the previous tensor's memory
    is released then: the writer's reference stays, its storage becomes empty.
    """

    def __init__(self, read_by_key: dict[str, Callable[[], torch.Tensor]], progress: Progress):
        super().__init__()
        self.read_by_key = read_by_key
        self.progress = progress
        self.previous: torch.Tensor | None = None

    def resolve_data(self, write_item):
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO or key not in self.read_by_key:
            return super().resolve_data(write_item)
        self.release_previous()
        tensor = self.read_by_key[key]().contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            tensor = tensor.clone()  # a view: the writer would copy it, and the copy could not be released
        self.previous = tensor
        self.progress.advance(tensor.numel() * tensor.element_size())
        return tensor

    def release_previous(self) -> None:
        if self.previous is not None:
            self.previous.untyped_storage().resize_(0)
            self.previous = None


def write_dcp(tensors: list[SourceTensor], folder: Path, dtype: torch.dtype | None, source: Path) -> None:
    """A trainer-layout DCP step folder: "model" (+ "train_state" at step 0), COMPLETE and config.json."""
    folder.mkdir(parents=True)
    model = {t.name: torch.empty(t.shape, dtype=output_dtype(t, dtype), device="meta") for t in tensors}
    state = {"model": model, "train_state": {"step": 0, "epoch": 0, "skipped_steps": 0}}

    def read_cast(tensor: SourceTensor) -> torch.Tensor:
        return tensor.read().to(output_dtype(tensor, dtype))

    read_by_key = {f"model.{t.name}": functools.partial(read_cast, t) for t in tensors}
    progress = Progress("to-dcp", len(tensors), sum(output_dtype(t, dtype).itemsize * torch.Size(t.shape).numel()
                                                    for t in tensors))
    # one writer thread and no process group: items are resolved (read) one after another
    planner = _ReadOnDemandPlanner(read_by_key, progress)
    # one thread and no copy-ahead selects the serial loader: one tensor resolved at a time
    writer = FileSystemWriter(folder, thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps each rank's error: surface the original one
            raise next(iter(exc.failures.values()), exc) from None
    planner.release_previous()
    progress.finish()
    (folder / "config.json").write_text(json.dumps({"converted_from": str(source)}, indent=2) + "\n")
    (folder / "COMPLETE").write_text(json.dumps({"step": 0, "world_size": 1}))
