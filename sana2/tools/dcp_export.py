"""Export a DCP training checkpoint to the reference's files, one tensor in memory at a time.

Every output's tensor shapes and dtypes come from the DCP metadata, so each file's header
(torch.save's pickle, safetensors' JSON) is written first and the tensors are then read from
the shards and appended one by one (see torch_files.py and safetensors_files.py).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from sana2.tools.dcp_source import CheckpointError, DcpCheckpoint
from sana2.tools.progress import Progress
from sana2.tools.safetensors_files import (
    INDEX_NAME,
    SINGLE_NAME,
    Entry,
    SafetensorsStream,
    index_json,
    plan_shards,
    shard_file_name,
)
from sana2.tools.torch_files import ScratchBuffer, TensorSlot, TorchSaveStream, save_streamed

MODEL_FILE = "pytorch_model_fsdp.bin"  # Accelerate's FULL_STATE_DICT model file
OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"


@dataclass(frozen=True)
class Weight:
    """One exported model tensor: its state-dict name, the DCP key it is read from, its output dtype."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the weights (in order), the training position, and the reused read buffers."""

    source: DcpCheckpoint
    weights: list[Weight]
    step: int
    epoch: int
    weights_from: str  # "model" or "ema"
    model_only: bool
    read_buffer: ScratchBuffer = field(default_factory=ScratchBuffer, repr=False)
    cast_buffer: ScratchBuffer = field(default_factory=ScratchBuffer, repr=False)

    @property
    def folder_name(self) -> str:
        return f"epoch_{self.epoch}_step_{self.step}"

    def optimizer_keys(self) -> list[str]:
        if self.model_only:
            return []
        return [key for key in self.source.paths("optimizer") if self.source.is_tensor(key)]

    def read_weight(self, weight: Weight) -> torch.Tensor:
        """The weight in its exported dtype, in reused memory: valid until the next read."""
        stored = self.source.read_tensor(weight.key, self.read_buffer)
        if stored.dtype == weight.dtype:
            return stored
        cast = self.cast_buffer.tensor(weight.shape, weight.dtype)
        cast.copy_(stored)
        return cast

    def read_state(self, key: str) -> torch.Tensor:
        """A non-weight tensor (optimizer state) as saved, in reused memory: valid until the next read."""
        return self.source.read_tensor(key, self.read_buffer)

    def source_bytes(self, keys) -> int:
        total = 0
        for key in keys:
            entry = self.source.tensor_metadata(key)
            total += entry.size.numel() * entry.properties.dtype.itemsize
        return total


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
        key = ema[name] if use_ema and name in ema else model_key
        entry = source.tensor_metadata(key)
        if entry.size != source.tensor_metadata(model_key).size:
            raise CheckpointError(
                f"EMA tensor {name} has shape {tuple(entry.size)}, "
                f"the model's is {tuple(source.tensor_metadata(model_key).size)}"
            )
        stored = entry.properties.dtype
        weights.append(Weight(name, key, tuple(entry.size), dtype if dtype and stored.is_floating_point else stored))
    train = training_position(source)
    return ExportPlan(source, weights, train["step"], train["epoch"], "ema" if use_ema else "model", model_only)


def training_position(source: DcpCheckpoint) -> dict:
    """step and epoch from train_state (COMPLETE's step and epoch 0 where there is none)."""
    train = source.nested("train_state") if source.has("train_state") else {}
    return {"step": int(train.get("step", source.complete.get("step", 0))), "epoch": int(train.get("epoch", 0))}


def model_slots(plan: ExportPlan) -> dict[str, TensorSlot]:
    return {w.name: TensorSlot(w.shape, w.dtype, w) for w in plan.weights}


def optimizer_structure(source: DcpCheckpoint) -> dict:
    """The full optimizer state keyed by parameter name, tensors as slots, state in parameter order."""
    optimizer = source.nested(
        "optimizer", tensor_leaf=lambda key, entry: TensorSlot(tuple(entry.size), entry.properties.dtype, key)
    )
    state = optimizer.get("state", {})
    order = [name for group in optimizer.get("param_groups", []) for name in group.get("params", [])]
    ordered = {name: state[name] for name in order if name in state}
    ordered.update((name, value) for name, value in state.items() if name not in ordered)
    return {"state": ordered, "param_groups": optimizer.get("param_groups", [])}


def rng_states(source: DcpCheckpoint) -> dict[int, dict]:
    """rank -> that rank's saved RNG states, by rank."""
    saved = source.nested("rng") if source.has("rng") else {}
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
        metadata["scheduler"] = plan.source.nested("lr_scheduler")
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


def export_bytes(plan: ExportPlan, form: str) -> int:
    """About how many bytes an export writes (for the free-space check)."""
    model = sum(w.nbytes for w in plan.weights)
    if form == "accelerate":
        return 2 * model + plan.source_bytes(plan.optimizer_keys())
    return model


def _progress(plan: ExportPlan, label: str, extra_keys=()) -> Progress:
    return Progress(
        label,
        len(plan.weights) + len(extra_keys),
        plan.source_bytes(w.key for w in plan.weights) + plan.source_bytes(extra_keys),
    )


def _stream_weights(plan: ExportPlan, weights: list[Weight], streams: list, progress: Progress) -> None:
    """Read each weight once and append it to every stream (all expect these weights in this order)."""
    for weight in weights:
        tensor = plan.read_weight(weight)
        for stream in streams:
            stream.write(tensor)
        entry = plan.source.tensor_metadata(weight.key)
        progress.advance(entry.size.numel() * entry.properties.dtype.itemsize)


def export_pth(plan: ExportPlan, path: Path) -> None:
    """{"state_dict": model} as one torch.save file."""
    progress = _progress(plan, "pth")
    with TorchSaveStream(path, {"state_dict": model_slots(plan)}) as stream:
        _stream_weights(plan, plan.weights, [stream], progress)
    progress.finish()


def export_accelerate(plan: ExportPlan, folder: Path, pth_path: Path) -> None:
    """The reference's Accelerate FSDP checkpoint folder plus the epoch_<E>_step_<S>.pth beside it."""
    optimizer_keys = plan.optimizer_keys()
    progress = _progress(plan, "accelerate", optimizer_keys)
    model_dir = folder / "model"
    model_dir.mkdir(parents=True)
    slots = model_slots(plan)
    with (
        TorchSaveStream(model_dir / MODEL_FILE, slots) as model_stream,
        TorchSaveStream(pth_path, {"state_dict": slots}) as pth_stream,
    ):
        _stream_weights(plan, plan.weights, [model_stream, pth_stream], progress)
    if not plan.model_only:
        _export_training_state(plan, model_dir, progress)
    torch.save(reference_metadata(plan), folder / "metadata.pth")
    progress.finish()


def _export_training_state(plan: ExportPlan, model_dir: Path, progress: Progress) -> None:
    source = plan.source
    if source.has("optimizer"):

        def read(slot: TensorSlot) -> torch.Tensor:
            tensor = plan.read_state(slot.source)
            progress.advance(tensor.numel() * tensor.element_size())
            return tensor

        save_streamed(model_dir / OPTIMIZER_FILE, optimizer_structure(source), read)
    if source.has("lr_scheduler"):
        torch.save(source.nested("lr_scheduler"), model_dir / SCHEDULER_FILE)
    for rank, states in rng_states(source).items():
        torch.save(accelerate_random_states(states, plan.step), model_dir / f"random_states_{rank}.pkl")


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
    progress = _progress(plan, "safetensors")
    entries = [Entry(w.name, w.shape, w.dtype) for w in plan.weights]
    metadata = safetensors_metadata(plan)
    if single_file:
        shards, paths = [entries], [target]
    else:
        target.mkdir(parents=True)
        shards = plan_shards(entries, max_shard_bytes)
        names = [SINGLE_NAME] if len(shards) == 1 else [shard_file_name(i, len(shards)) for i in range(len(shards))]
        paths = [target / name for name in names]
        if len(shards) > 1:
            (target / INDEX_NAME).write_text(index_json(shards, metadata))
    weights = iter(plan.weights)
    for shard, path in zip(shards, paths):
        with SafetensorsStream(path, shard, metadata) as stream:
            _stream_weights(plan, [next(weights) for _ in shard], [stream], progress)
    progress.finish()
