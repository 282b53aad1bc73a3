"""Export a DCP training checkpoint to the reference's files, one tensor in memory at a time.

An output format is an ordered list of SourceTensors named by their output keys (the model's state
dict, cast or taken from the EMA), or a structure with SourceTensor leaves (the optimizer state),
handed to one streaming writer: `save_torch_file(s)` or `write_safetensors(_folder)`. Each tensor is
read from the DCP shards when the writer reaches it.
"""

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.safetensors_file import write_safetensors, write_safetensors_folder
from sana2.formats.tensors import CheckpointError, SourceTensor, tensor_leaves
from sana2.formats.torch_file import save_torch_file, save_torch_files
from sana2.tools.progress import Progress

MODEL_FILE = "pytorch_model_fsdp.bin"  # Accelerate's FULL_STATE_DICT model file
OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the weights (output name, source, output dtype; in order) and the training position."""

    source: DcpCheckpoint
    weights: list[SourceTensor]
    step: int
    epoch: int
    weights_from: str  # "model" or "ema"
    model_only: bool

    @property
    def folder_name(self) -> str:
        return f"epoch_{self.epoch}_step_{self.step}"

    def state_dict(self) -> dict[str, SourceTensor]:
        return {weight.name: weight for weight in self.weights}

    @cached_property
    def optimizer(self) -> dict | None:
        """The full optimizer state keyed by parameter name (tensors as SourceTensors), or None."""
        if self.model_only or not self.source.has("optimizer"):
            return None
        optimizer = self.source.nested("optimizer")
        state = optimizer.get("state", {})
        order = [name for group in optimizer.get("param_groups", []) for name in group.get("params", [])]
        ordered = {name: state[name] for name in order if name in state}
        ordered.update((name, value) for name, value in state.items() if name not in ordered)
        return {"state": ordered, "param_groups": optimizer.get("param_groups", [])}


def plan_export(source: DcpCheckpoint, use_ema: bool, dtype: torch.dtype | None, model_only: bool) -> ExportPlan:
    """Which tensor each exported weight comes from (EMA weights replace parameters; buffers stay)."""
    model = {path[1]: key for key, path in source.paths("model").items() if len(path) == 2}
    if not model:
        raise CheckpointError(f"{source.folder} has no 'model' entry")
    ema = {path[1]: key for key, path in source.paths("ema").items() if len(path) == 2}
    if use_ema and not ema:
        raise CheckpointError(f"{source.folder} has no EMA weights (it was saved without EMA); drop --ema")
    unknown = sorted(set(ema) - set(model))
    if use_ema and unknown:
        raise CheckpointError(f"EMA tensor {unknown[0]} is not a model tensor")
    weights = []
    for name, model_key in model.items():
        weight = source.tensor(ema[name] if use_ema and name in ema else model_key).renamed(name)
        model_shape = source.tensor(model_key).shape
        if weight.shape != model_shape:
            raise CheckpointError(f"EMA tensor {name} has shape {weight.shape}, the model's is {model_shape}")
        weights.append(weight.to(dtype) if dtype is not None else weight)
    train = source.nested("train_state", read_tensors=True) if source.has("train_state") else {}
    step, epoch = int(train.get("step", source.complete.get("step", 0))), int(train.get("epoch", 0))
    return ExportPlan(source, weights, step, epoch, "ema" if use_ema else "model", model_only)


def rng_states(source: DcpCheckpoint) -> dict[int, dict]:
    """rank -> that rank's saved RNG states, by rank."""
    saved = source.nested("rng", read_tensors=True) if source.has("rng") else {}
    return dict(sorted((int(name.removeprefix("rank")), states) for name, states in saved.items()))


def accelerate_random_states(states: dict, step: int) -> dict:
    """A rank's RNG states under the keys Accelerate's random_states_<rank>.pkl uses."""
    converted = {
        "step": step,
        "random_state": states["python"],
        "numpy_random_seed": states["numpy"],
        "torch_manual_seed": states["torch"],
    }
    if states.get("cuda") is not None:
        converted["torch_cuda_manual_seed"] = states["cuda"]
    return converted


def reference_metadata(plan: ExportPlan) -> dict:
    """epoch_<E>_step_<S>/metadata.pth as the reference writes it (rank 0's RNG states)."""
    metadata = {"step": plan.step, "epoch": plan.epoch}
    if plan.model_only:
        return metadata
    if plan.source.has("lr_scheduler"):
        metadata["scheduler"] = plan.source.nested("lr_scheduler", read_tensors=True)
    states = rng_states(plan.source)
    if states:
        first = states[min(states)]
        metadata["rng_state"] = {
            "torch": first["torch"],
            "torch_cuda": first.get("cuda") or [],
            "numpy": first["numpy"],
            "python": first["python"],
        }
    return metadata


def small_files(plan: ExportPlan) -> dict[str, object]:
    """Accelerate folder path -> content of each small file, written with plain torch.save."""
    files: dict[str, object] = {"metadata.pth": reference_metadata(plan)}
    if not plan.model_only:
        if plan.source.has("lr_scheduler"):
            files[f"model/{SCHEDULER_FILE}"] = plan.source.nested("lr_scheduler", read_tensors=True)
        for rank, states in rng_states(plan.source).items():
            files[f"model/random_states_{rank}.pkl"] = accelerate_random_states(states, plan.step)
    return files


def export_bytes(plan: ExportPlan, form: str) -> int:
    """About how many bytes an export writes (for the free-space check)."""
    model = sum(w.nbytes for w in plan.weights)
    if form != "accelerate":
        return model
    optimizer = plan.optimizer
    return 2 * model + sum(t.nbytes for t in tensor_leaves(optimizer)) if optimizer else 2 * model


def export_pth(plan: ExportPlan, path: Path) -> None:
    """{"state_dict": model} as one torch.save file."""
    progress = Progress("pth", plan.weights)
    save_torch_file(path, {"state_dict": progress.track(plan.state_dict())})
    progress.finish()


def export_accelerate(plan: ExportPlan, folder: Path, pth_path: Path) -> None:
    """The reference's Accelerate FSDP checkpoint folder plus the epoch_<E>_step_<S>.pth beside it."""
    optimizer = plan.optimizer
    progress = Progress("accelerate", plan.weights + tensor_leaves(optimizer))
    (folder / "model").mkdir(parents=True)
    weights = progress.track(plan.state_dict())
    save_torch_files({folder / "model" / MODEL_FILE: weights, pth_path: {"state_dict": weights}})  # each read once
    if optimizer is not None:
        save_torch_file(folder / "model" / OPTIMIZER_FILE, progress.track(optimizer))
    for name, content in small_files(plan).items():
        torch.save(content, folder / name)
    progress.finish()


def safetensors_metadata(plan: ExportPlan) -> dict[str, str]:
    dtypes = sorted({str(w.dtype).removeprefix("torch.") for w in plan.weights})
    return {
        "format": "pt",
        "step": str(plan.step),
        "epoch": str(plan.epoch),
        "weights": plan.weights_from,
        "dtype": ",".join(dtypes),
        "source": "sana2 DCP checkpoint",
    }


def export_safetensors(plan: ExportPlan, target: Path, single_file: bool, max_shard_bytes: int) -> None:
    """One .safetensors file, or a folder with model.safetensors or an index and numbered shards."""
    progress = Progress("safetensors", plan.weights)
    weights = list(progress.track(plan.state_dict()).values())
    if single_file:
        write_safetensors(target, weights, safetensors_metadata(plan))
    else:
        target.mkdir()
        write_safetensors_folder(target, weights, safetensors_metadata(plan), max_shard_bytes)
    progress.finish()
