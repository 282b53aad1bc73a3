"""--to-dcp: turn a full model checkpoint into a DCP folder a sharded model can dcp.load.

Accepted inputs are what full_checkpoint.py reads (the same reader as checkpoint.initial_load_path):
the reference's {"state_dict": ...} .pth, Accelerate's pytorch_model_fsdp.bin, a plain or
DDP-prefixed state dict, a legacy torch file, or safetensors (a file, or a folder with
model.safetensors or an index and shards). Every tensor is kept, `pos_embed` included. The DCP
folder holds "model" and "train_state" (step 0), the CRC32 list of each data file, COMPLETE and
config.json, as the trainer writes them.

dcp.save is given meta tensors (shapes and dtypes only) and a planner that reads each tensor
from the input file when the writer asks for it, so one tensor is in memory at a time.
"""

import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from sana2.components.checkpoint import COMPLETE_MARKER, ChecksummingWriter
from sana2.tools.full_checkpoint import SourceTensor
from sana2.tools.progress import Progress


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
    progress = Progress(
        "to-dcp", len(tensors), sum(output_dtype(t, dtype).itemsize * torch.Size(t.shape).numel() for t in tensors)
    )
    # one writer thread and no process group: items are resolved (read) one after another
    planner = _ReadOnDemandPlanner(read_by_key, progress)
    # one thread and no copy-ahead selects the serial loader: one tensor resolved at a time; the
    # trainer's writer adds each data file's CRC32 list, so loads and conversions of it are checked
    writer = ChecksummingWriter(folder, thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        try:
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps each rank's error: surface the original one
            raise next(iter(exc.failures.values()), exc) from None
    planner.release_previous()
    progress.finish()
    (folder / "config.json").write_text(json.dumps({"converted_from": str(source)}, indent=2) + "\n")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"step": 0, "world_size": 1, "checksums": True}))
