"""--to-dcp: turn a full model checkpoint into a DCP folder a sharded model can dcp.load.

Accepted inputs are what sana2/formats/full_model.py reads (the same reader as
checkpoint.initial_load_path), diffusers folders included. Every tensor is kept, `pos_embed` included
(a diffusers folder's is the model's computed value). The DCP folder holds "model" and "train_state"
(a fresh TrainState: step 0), the CRC32 list of each data file, config.json and COMPLETE, finished by
the step-folder writer the trainer's checkpoints use (sana2/formats/step_folder.py).

dcp.save is given meta tensors (shapes and dtypes only) and a planner that reads each tensor from
the input file when the writer asks for it, so one tensor is in memory at a time. (DCP's
HuggingFaceStorageWriter does not fit here: it keeps every tensor of a file until the file is written.)
"""

import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from sana2.cli import CONFIG_JSON
from sana2.components.train_state import TrainState
from sana2.formats.dcp_folder import ChecksummingWriter
from sana2.formats.step_folder import finish_step_folder
from sana2.formats.tensors import SourceTensor
from sana2.tools.progress import progress_bar, tracked


class _ReadOnDemandPlanner(DefaultSavePlanner):
    """Resolves each "model" tensor by reading it from the input file when the writer reaches it.

    FileSystemWriter keeps a reference to every tensor it wrote to a shard file until the file is
    closed (it needs them only for its safetensors mode). With the serial loader, a tensor has
    been written out completely when the next one is resolved, so the previous tensor's memory
    is released then: the writer's reference stays, its storage becomes empty.
    """

    def __init__(self, sources: dict[str, SourceTensor]):
        super().__init__()
        self.sources = sources
        self.previous: torch.Tensor | None = None

    def resolve_data(self, write_item):
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO or key not in self.sources:
            return super().resolve_data(write_item)
        self.release_previous()
        self.previous = self.sources[key].read()
        return self.previous

    def release_previous(self) -> None:
        if self.previous is not None:
            self.previous.untyped_storage().resize_(0)
            self.previous = None


def write_dcp(tensors: list[SourceTensor], folder: Path, config: dict) -> None:
    """A trainer-layout DCP step folder: `tensors` as "model", a fresh TrainState as "train_state",
    config.json holding `config` (where the tensors came from; the model, where the input names it), COMPLETE."""
    folder.mkdir(parents=True)
    model = {t.name: torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors}
    bar = progress_bar("to-dcp", tensors)
    planner = _ReadOnDemandPlanner({f"model.{t.name}": t for t in tracked(tensors, bar)})
    # one thread and no copy-ahead select the serial loader: one tensor resolved at a time; the
    # trainer's writer adds each data file's CRC32 list, so loads and conversions of it are checked
    writer = ChecksummingWriter(folder, thread_count=1, per_thread_copy_ahead=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        try:
            state = {"model": model, "train_state": TrainState().state_dict()}
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps each rank's error: surface the original one
            raise next(iter(exc.failures.values()))[0] from None
        finally:
            bar.close()
    planner.release_previous()
    finish_step_folder(
        folder, step=0, world_size=1, files={CONFIG_JSON: json.dumps(config, indent=2) + "\n"}, sequence=1
    )
