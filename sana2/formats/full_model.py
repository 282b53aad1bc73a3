"""Full (unsharded) model checkpoints: the one reader used by initial loads and by `sana2-convert --to-dcp`.

Accepted, each read one tensor (or one range of dim-0 rows) at a time:
- a torch.save file of a state dict: the reference's `{"state_dict": ...}` .pth, Accelerate's
  `pytorch_model_fsdp.bin` (or the `model/` folder holding it), a plain state dict; a legacy
  (non-zip) torch file is read whole, as that format cannot be read in parts;
- safetensors: one file, or a folder with one file or an index and its shards;
- a diffusers folder of a Sana transformer (sana2/formats/diffusers_folder.py), its tensors mapped
  back to sana2's names: Sana's released weights are published in that form.
Keys lose a leading `module.` (DDP's wrapper). Nothing is dropped: whether `pos_embed` matters is
the caller's decision. A diffusers folder holds no null caption (`y_embedder.y_embedding`) unless
sana2 wrote it. Every problem is a CheckpointError naming the file.
"""

from collections.abc import Mapping
from pathlib import Path

from sana2.formats.diffusers_folder import config_problem, is_diffusers_folder, read_diffusers_folder
from sana2.formats.safetensors_file import SUFFIX, is_safetensors_folder, read_safetensors_checkpoint
from sana2.formats.tensors import CheckpointError, SourceTensor
from sana2.formats.torch_file import read_torch_file

ACCELERATE_MODEL_FILE = "pytorch_model_fsdp.bin"  # Accelerate's FULL_STATE_DICT model file
DDP_PREFIX = "module."


def is_full_checkpoint(path: Path) -> bool:
    """Whether `path` is for this reader: a file, or a folder of safetensors (diffusers' too) or Accelerate's
    model/ (not DCP)."""
    path = Path(path)
    if path.is_file():
        return True
    return (
        path.is_dir()
        and not (path / ".metadata").exists()
        and ((path / ACCELERATE_MODEL_FILE).is_file() or is_safetensors_folder(path))
    )


def read_full_checkpoint(path: str | Path) -> list[SourceTensor]:
    """The model tensors of a full checkpoint, in file order, named by their state-dict keys."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_dir():
        if (path / ".metadata").exists():
            raise CheckpointError(f"{path} is a DCP checkpoint folder, not a full-model file")
        if is_diffusers_folder(path):
            return read_diffusers_folder(path)
        problem = config_problem(path)
        if problem is not None:
            raise CheckpointError(f"diffusers folder {path}: {problem}")
        if is_safetensors_folder(path):
            return _without_ddp_prefix(path, read_safetensors_checkpoint(path))
        if not (path / ACCELERATE_MODEL_FILE).is_file():
            raise CheckpointError(f"{path} holds neither {ACCELERATE_MODEL_FILE} nor safetensors files")
        path = path / ACCELERATE_MODEL_FILE  # the model/ folder of an Accelerate FULL_STATE_DICT checkpoint
    if path.suffix == SUFFIX:
        return _without_ddp_prefix(path, read_safetensors_checkpoint(path))
    root = read_torch_file(path)
    state = root
    if isinstance(root, Mapping) and isinstance(root.get("state_dict"), Mapping):
        state = root["state_dict"]  # the reference's epoch_<E>_step_<S>.pth
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{path} holds no state dict (found {type(state).__name__})")
    tensors = []
    for name, value in state.items():
        if not isinstance(value, SourceTensor):
            raise CheckpointError(f"{path}: entry {name!r} of the state dict is not a tensor ({type(value).__name__})")
        tensors.append(value.renamed(str(name)))
    return _without_ddp_prefix(path, tensors)


def _without_ddp_prefix(path: Path, tensors: list[SourceTensor]) -> list[SourceTensor]:
    stripped = [tensor.renamed(tensor.name.removeprefix(DDP_PREFIX)) for tensor in tensors]
    seen: set[str] = set()
    for tensor in stripped:
        if tensor.name in seen:
            raise CheckpointError(f"{path} holds {tensor.name} twice (with and without the {DDP_PREFIX!r} prefix)")
        seen.add(tensor.name)
    return stripped
