"""Export a DCP training checkpoint to the reference's files, one tensor in memory at a time.

An output format is an ordered list of SourceTensors named by their output keys (the model's state
dict, cast or taken from the EMA), or a structure with SourceTensor leaves (the optimizer state),
handed to one streaming writer: `save_torch_file(s)` or `write_safetensors(_folder)`. Each tensor is
read from the DCP shards when the writer reaches it.

The Accelerate folder is the one Sana's trainer resumes from: what goes into each file, and why, is
sana2/tools/sana_layout.py's (docs/sana-interop.md). The diffusers folder is
sana2/formats/diffusers_folder.py's.
"""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from sana2.cli import CONFIG_JSON, CONFIG_TOML
from sana2.components.lora import is_adapter
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.diffusers import LORA_PREFIX, NOT_IN_DIFFUSERS, VIDEO_CLASS, diffusers_config, lora_modules
from sana2.formats.diffusers_folder import NULL_CAPTION_KEY, diffusers_tensors, piece_tensor, write_diffusers_folder
from sana2.formats.safetensors_file import write_safetensors, write_safetensors_folder
from sana2.formats.tensors import CheckpointError, SourceTensor, check_shapes, tensor_leaves
from sana2.formats.torch_file import save_torch_file, save_torch_files
from sana2.models import build_model
from sana2.tools.progress import progress_bar, tracked
from sana2.tools.sana_layout import (
    METADATA_FILE,
    MODEL_DIR,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    StateTensor,
    StoredTensor,
    folder_name,
    latest_pointer,
    metadata,
    optimizer_state,
    random_states,
    random_states_file,
    replace_state_tensors,
    sana_epoch,
    sana_global_step,
    scaler_state,
    scheduler_state,
)


@dataclass(frozen=True)
class ExportPlan:
    """What an export writes: the weights (output name, source, output dtype; in order), the training
    position, and how the Sana run that resumes from an Accelerate export is set up."""

    source: DcpCheckpoint
    weights: list[SourceTensor]
    step: int  # optimizer steps done
    epoch: int  # sana2's epoch in progress, from 0
    weights_from: str  # "model" or "ema"
    model_only: bool
    run_config: dict  # the step folder's config.json ({} without one)
    processes: int  # processes of the Sana run that resumes (its scheduler steps once per process)
    per_parameter_groups: bool = True  # Sana's optimizer: one param group per parameter

    @property
    def global_step(self) -> int:
        """Sana's S: micro-batches of one rank."""
        accumulation = int(self.run_config.get("training", {}).get("gradient_accumulation_steps", 1))
        return sana_global_step(self.step, accumulation)

    @property
    def folder_name(self) -> str:
        return folder_name(sana_epoch(self.epoch), self.global_step)

    def state_dict(self) -> dict[str, SourceTensor]:
        return {weight.name: weight for weight in self.weights}

    def model(self) -> tuple[str, dict[str, Any]]:
        """The run's model: registry name and constructor overrides, from config.json."""
        model = dict(self.run_config.get("model") or {})
        name = model.pop("name", None)
        model.pop("pretrained", None)  # where the run started from, not a model keyword
        if not name:
            raise CheckpointError(f"{self.source.folder / CONFIG_JSON} names no model (its [model] section)")
        return name, model

    @cached_property
    def optimizer(self) -> dict | None:
        """optimizer.bin: sana2's optimizer state in Sana's param groups and parameter order (Accelerate
        FSDP layout, keyed by name; CAME's state as Sana's CAMEWrapper keeps it), or None."""
        if self.model_only or not self.source.has("optimizer"):
            return None
        saved = self.source.nested("optimizer")
        groups, state = saved.get("param_groups", []), saved.get("state", {})
        if len(groups) != 1:
            raise CheckpointError(f"{self.source.folder}: {len(groups)} optimizer param groups, not sana2's one")
        (group,) = groups
        kind = "came" if "clip_threshold" in group else "adamw"
        params = [(name, _stored(name, state.get(name, {}), self.source)) for name in group["params"]]
        structure = optimizer_state(params, group, kind, "fsdp", self.per_parameter_groups)
        return replace_state_tensors(structure, lambda leaf: _state_source(leaf, state))

    @cached_property
    def scheduler(self) -> dict | None:
        """scheduler.bin: Sana's LambdaLR state at this step (None without optimizer state)."""
        if self.optimizer is None:
            return None
        groups = self.optimizer["param_groups"]
        lr = groups[0]["lr"]
        return scheduler_state(groups[0].get("initial_lr", lr), lr, len(groups), self.step, self.processes)


def _stored(name: str, state: dict, source: DcpCheckpoint) -> dict[str, StoredTensor]:
    stored = {}
    for key, value in state.items():
        if not isinstance(value, SourceTensor):
            raise CheckpointError(f"{source.folder}: optimizer state {name}.{key} is not a tensor")
        stored[key] = StoredTensor(value.shape, value.dtype)
    return stored


def _state_source(leaf: StateTensor, state: dict) -> SourceTensor:
    """A tensor of Sana's optimizer state as a SourceTensor: sana2's own, or computed from it when read."""
    if leaf.copied:
        return state[leaf.param][leaf.sources[0]]

    def fill(out: torch.Tensor, start: int) -> None:
        value = leaf.materialize(lambda param, key: state[param][key].read())
        out.copy_(value[start : start + out.shape[0]] if value.dim() else value)

    return SourceTensor(f"{leaf.param}:{'+'.join(leaf.sources)}", leaf.shape, leaf.dtype, fill)


def read_run_config(folder: Path) -> dict:
    path = folder / CONFIG_JSON
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    return config if isinstance(config, dict) else {}


def plan_export(
    source: DcpCheckpoint,
    use_ema: bool,
    dtype: torch.dtype | None,
    model_only: bool,
    processes: int | None = None,
    per_parameter_groups: bool = True,
    merge_lora: bool = False,
    lora_adapters: bool = False,
) -> ExportPlan:
    """Which tensor each exported weight comes from (EMA weights replace parameters; buffers stay).

    processes: of the Sana run that resumes; default the world size the checkpoint was saved at.
    merge_lora: a LoRA run's step folder exports its base with the adapters merged in (merged_lora_weights).
    lora_adapters: a LoRA run's step folder exports its adapters only, in diffusers' names (diffusers_lora_weights).
    """
    model = {path[1]: key for key, path in source.paths("model").items() if len(path) == 2}
    if not model:
        raise CheckpointError(f"{source.folder} has no 'model' entry")
    adapters = [name for name in model if is_adapter(name)]
    if adapters and not (merge_lora or lora_adapters):
        _refuse_adapters(source, adapters[0])
    if (merge_lora or lora_adapters) and not adapters:
        flag = "--merge-lora" if merge_lora else "--format diffusers-lora"
        raise CheckpointError(f"{source.folder} holds no LoRA adapters (it is no LoRA run's); drop {flag}")
    ema = {path[1]: key for key, path in source.paths("ema").items() if len(path) == 2}
    if use_ema and not ema:
        raise CheckpointError(f"{source.folder} has no EMA weights (it was saved without EMA); drop --ema")
    unknown = sorted(set(ema) - set(model))
    if use_ema and unknown:
        raise CheckpointError(f"EMA tensor {unknown[0]} is not a model tensor")
    if lora_adapters:
        weights = diffusers_lora_weights(source, use_ema)
        model_only = True
    elif adapters:
        weights = merged_lora_weights(source, use_ema)
        model_only = True  # the optimizer state is the adapters': nothing a merged model resumes from
    else:
        weights = []
        for name, model_key in model.items():
            weight = source.tensor(ema[name] if use_ema and name in ema else model_key).renamed(name)
            model_shape = source.tensor(model_key).shape
            if weight.shape != model_shape:
                raise CheckpointError(f"EMA tensor {name} has shape {weight.shape}, the model's is {model_shape}")
            weights.append(weight)
    if dtype is not None:
        weights = [weight.to(dtype) for weight in weights]
    train = source.nested("train_state", read_tensors=True) if source.has("train_state") else {}
    step, epoch = int(train.get("step", source.complete.get("step", 0))), int(train.get("epoch", 0))
    saved_ranks = len(rng_states(source)) or 1
    processes = processes or int(source.complete.get("world_size", saved_ranks))
    return ExportPlan(
        source,
        weights,
        step,
        epoch,
        "ema" if use_ema else "model",
        model_only,
        read_run_config(source.folder),
        processes,
        per_parameter_groups,
    )


def _refuse_adapters(source: DcpCheckpoint, adapter: str) -> None:
    """A LoRA run's step folder holds its adapters, not its frozen base: exported as it is, the output would
    be a model without most of its weights, so it is refused, naming the base and the exports that do hold it."""
    base = read_run_config(source.folder).get("checkpoint", {}).get("initial_load_path") or "not named"
    raise CheckpointError(
        f"{source.folder} is a LoRA run's checkpoint: its model holds adapters (e.g. {adapter}), not the base "
        f"weights (checkpoint.initial_load_path: {base}); pass --merge-lora to export the base with the adapters "
        f"merged in (as sana2-sample {source.folder} draws it), or --format diffusers-lora to export the adapters "
        "as the file diffusers' SanaPipeline.load_lora_weights loads"
    )


def merged_lora_weights(source: DcpCheckpoint, use_ema: bool) -> list[SourceTensor]:
    """The plain model a LoRA run's step folder stands for: built and loaded as sana2-sample loads it (the
    base from checkpoint.initial_load_path, then the adapters, the EMA's with `use_ema`), in float32, with
    each adapter merged into its weight (W + alpha / rank * B A). The whole model is held in memory."""
    from sana2.components import lora
    from sana2.sample import load_model

    config = lora_run_config(source)
    model, _ = load_model(config, source.folder, use_ema, torch.float32, torch.device("cpu"), None)
    merged = lora.merged_state(model.state_dict(), lora.scaling(config.lora))
    return [SourceTensor.of(name, tensor) for name, tensor in merged.items()]


def diffusers_lora_weights(source: DcpCheckpoint, use_ema: bool) -> list[SourceTensor]:
    """A LoRA run's adapters (the EMA's with `use_ema`) as diffusers' LoRA file for SanaPipeline names them
    (sana2/formats/diffusers.py's lora_modules), with alpha / rank folded into B: a file without alphas is
    loaded by diffusers at scale 1, so B A is the same update sana2 applies."""
    from sana2.components import lora

    config = lora_run_config(source)
    video = diffusers_config(config.model.name, config.model.overrides)["_class_name"] == VIDEO_CLASS
    scale = lora.scaling(config.lora)
    stored = {path[1]: key for key, path in source.paths("ema" if use_ema else "model").items() if len(path) == 2}
    down = f".lora_A.{lora.ADAPTER}.weight"
    weights = []
    for name in stored:
        if not name.endswith(down):
            continue
        layer = name.removesuffix(down)
        up = stored.get(f"{layer}.lora_B.{lora.ADAPTER}.weight")
        if up is None:
            raise CheckpointError(f"{source.folder}: adapter {name} has no lora_B beside it")
        lora_a, lora_b = source.tensor(stored[name]), source.tensor(up)
        lora_b = lora_b.transformed(lambda b: b.float().mul(scale).to(b.dtype), lora_b.shape, lora_b.dtype)
        for piece in lora_modules(layer, video):
            module = f"{LORA_PREFIX}{piece.name}"
            weights.append(lora_a.renamed(f"{module}.lora_A.weight"))
            weights.append(piece_tensor(lora_b, piece).renamed(f"{module}.lora_B.weight"))
    return weights


def lora_run_config(source: DcpCheckpoint):
    """The job config of the LoRA run that saved `source`, from the step folder's config.toml."""
    from sana2.components import lora
    from sana2.config import load_config
    from sana2.formats.pipeline import pipeline_defaults

    path = source.folder / CONFIG_TOML
    if not path.is_file():
        raise CheckpointError(f"{source.folder} has no {CONFIG_TOML}: the LoRA run's config (its [lora] and base)")
    config = load_config(path, [], pipeline_defaults)
    if not lora.enabled(config):
        raise CheckpointError(f'{path}: holds LoRA adapters but model_transforms.names has no "lora"')
    if not config.checkpoint.initial_load_path:
        raise CheckpointError(f"{path}: LoRA adapters whose run names no base (checkpoint.initial_load_path)")
    return config


def rng_states(source: DcpCheckpoint) -> dict[int, dict]:
    """rank -> that rank's saved RNG states, by rank."""
    saved = source.nested("rng", read_tensors=True) if source.has("rng") else {}
    return dict(sorted((int(name.removeprefix("rank")), states) for name, states in saved.items()))


def small_files(plan: ExportPlan) -> dict[str, object]:
    """Accelerate folder path -> content of each small file, written with plain torch.save."""
    rng = rng_states(plan.source) if not plan.model_only else {}
    first = rng[min(rng)] if rng else None
    files: dict[str, object] = {
        METADATA_FILE: metadata(sana_epoch(plan.epoch), plan.global_step, plan.scheduler, first)
    }
    if plan.model_only:
        return files
    if plan.scheduler is not None:
        files[f"{MODEL_DIR}/{SCHEDULER_FILE}"] = plan.scheduler
    for rank, states in rng.items():
        files[f"{MODEL_DIR}/{random_states_file(rank)}"] = random_states(states, plan.global_step)
    files[f"{MODEL_DIR}/{SCALER_FILE}"] = scaler_state()  # read only by a Sana run in fp16
    return files


def latest_link(plan: ExportPlan) -> tuple[str, str] | None:
    """(name, target) of the latest pointer beside the folder (none for a model-only export)."""
    return None if plan.model_only else latest_pointer(plan.folder_name)


def export_bytes(plan: ExportPlan, form: str) -> int:
    """About how many bytes an export writes (for the free-space check)."""
    model = sum(w.nbytes for w in plan.weights)
    if form != "accelerate":
        return model
    optimizer = plan.optimizer
    return 2 * model + sum(t.nbytes for t in tensor_leaves(optimizer)) if optimizer else 2 * model


def export_pth(plan: ExportPlan, path: Path) -> None:
    """{"state_dict": model} as one torch.save file."""
    with progress_bar("pth", plan.weights) as bar:
        save_torch_file(path, {"state_dict": tracked(plan.state_dict(), bar)})


def export_accelerate(plan: ExportPlan, folder: Path, pth_path: Path, link: Path | None) -> None:
    """Sana's checkpoint folder (Accelerate FSDP layout), the epoch_<E>_step_<S>.pth beside it and, at
    `link`, the latest pointer to it."""
    optimizer = plan.optimizer
    (folder / MODEL_DIR).mkdir(parents=True)
    with progress_bar("accelerate", plan.weights + tensor_leaves(optimizer)) as bar:
        weights = tracked(plan.state_dict(), bar)
        save_torch_files({folder / MODEL_DIR / MODEL_FILE: weights, pth_path: {"state_dict": weights}})  # read once
        if optimizer is not None:
            save_torch_file(folder / MODEL_DIR / OPTIMIZER_FILE, tracked(optimizer, bar))
    for name, content in small_files(plan).items():
        torch.save(content, folder / name)
    if link is not None:
        link.symlink_to(latest_link(plan)[1])  # relative: resolved beside the link once both are in place


SAFETENSORS_SOURCE = "sana2 DCP checkpoint"  # also marks a file sana2-convert may replace


def safetensors_metadata(plan: ExportPlan) -> dict[str, str]:
    dtypes = sorted({str(w.dtype).removeprefix("torch.") for w in plan.weights})
    return {
        "format": "pt",
        "step": str(plan.step),
        "epoch": str(plan.epoch),
        "weights": plan.weights_from,
        "dtype": ",".join(dtypes),
        "source": SAFETENSORS_SOURCE,
    }


LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # the file diffusers' load_lora_weights(folder) reads


def export_safetensors(
    plan: ExportPlan, target: Path, single_file: bool, max_shard_bytes: int, folder: bool = False
) -> None:
    """One .safetensors file (in a new folder of its own with `folder`), or a folder with model.safetensors or
    an index and numbered shards."""
    with progress_bar("safetensors", plan.weights) as bar:
        weights = list(tracked(plan.state_dict(), bar).values())
        if single_file:
            if folder:
                target.parent.mkdir()
            write_safetensors(target, weights, safetensors_metadata(plan))
        else:
            target.mkdir()
            write_safetensors_folder(target, weights, safetensors_metadata(plan), max_shard_bytes)


def diffusers_folder_config(plan: ExportPlan) -> dict[str, Any]:
    """config.json of the diffusers folder: the run's model as diffusers describes it, after checking
    that the checkpoint holds that model's tensors."""
    import diffusers

    name, overrides = plan.model()
    config = diffusers_config(name, overrides)
    with torch.device("meta"):
        expected = {key: tuple(t.shape) for key, t in build_model(name, **overrides).state_dict().items()}
    held = {w.name: w.shape for w in plan.weights}
    # a checkpoint imported from diffusers may lack what diffusers does not hold; it exports all the same
    expected = {key: shape for key, shape in expected.items() if key in held or key not in NOT_IN_DIFFUSERS}
    check_shapes(f"{plan.source.folder} (model of {CONFIG_JSON})", held, expected)
    return {**config, "_diffusers_version": diffusers.__version__}


def diffusers_export_tensors(plan: ExportPlan, config: dict[str, Any]) -> tuple[list[SourceTensor], list[SourceTensor]]:
    """(the diffusers tensors, sana2's null caption) an export of `plan` writes."""
    video = config["_class_name"] == VIDEO_CLASS
    null = [weight for weight in plan.weights if weight.name == NULL_CAPTION_KEY]
    return diffusers_tensors(plan.weights, video), null


def export_diffusers(plan: ExportPlan, target: Path, config: dict[str, Any], max_shard_bytes: int) -> None:
    """A diffusers model folder: config.json, the weights (sharded above max_shard_bytes), sana2's null caption."""
    tensors, null = diffusers_export_tensors(plan, config)
    target.mkdir()
    with progress_bar("diffusers", tensors + null) as bar:
        read = tracked(tensors + null, bar)
        write_diffusers_folder(
            target, config, read[: len(tensors)], read[len(tensors) :], safetensors_metadata(plan), max_shard_bytes
        )
