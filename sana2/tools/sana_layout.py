"""What Sana's trainer and Accelerate resume from, computed from a sana2 checkpoint's content.

docs/sana-interop.md says what Sana and Accelerate read and why each value is what it is; this
module computes those values. Everything is a pure function of names, shapes, small scalars and
one tensor at a time: the optimizer state comes back as a structure whose tensor leaves are
`StateTensor` recipes (shape and dtype known up front, the value computed from a few sana2 tensors
of the same parameter when the writer asks), so an export streams one tensor at a time.

The folder an export writes (Sana's `save_checkpoint_fsdp` layout, Accelerate FULL_STATE_DICT):

    <out>/epoch_<E>_step_<S>/model/pytorch_model_fsdp.bin   the weights (names unchanged)
    <out>/epoch_<E>_step_<S>/model/optimizer.bin           `optimizer_state(...)`
    <out>/epoch_<E>_step_<S>/model/scheduler.bin           `scheduler_state(...)`
    <out>/epoch_<E>_step_<S>/model/random_states_<r>.pkl    `random_states(...)`, one per saving rank
    <out>/epoch_<E>_step_<S>/model/scaler.pt               `scaler_state()`, for a run resuming in fp16
    <out>/epoch_<E>_step_<S>/metadata.pth                  `metadata(...)`
    <out>/epoch_<E>_step_<S>.pth                           {"state_dict": weights}
    <out>/latest.pth -> epoch_<E>_step_<S>                 `latest_pointer(...)`
"""

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MODEL_DIR = "model"
# Accelerate's FULL_STATE_DICT file names inside model/
MODEL_FILE = "pytorch_model_fsdp.bin"
OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.bin"
SCALER_FILE = "scaler.pt"
METADATA_FILE = "metadata.pth"
LATEST_LINK = "latest.pth"
OPTIMIZERS = ("adamw", "came")
# "fsdp": Sana under Accelerate FSDP (use_orig_params): its optimizer sees flat 1-D shards.
# "unsharded": Sana without FSDP (DDP or one process): its optimizer sees the parameters' shapes.
LAYOUTS = ("fsdp", "unsharded")
# param-group entries that pick an implementation rather than a hyperparameter: Sana's run keeps its own
EXECUTION_OPTIONS = ("foreach", "fused", "capturable", "differentiable")


class SanaLayoutError(ValueError):
    """sana2 state that cannot become what Sana loads; the message names the parameter or value."""


# -- folder names, epochs, steps -------------------------------------------------------------------


def sana_epoch(sana2_epoch: int) -> int:
    """Sana numbers epochs from 1; sana2's train_state epoch is the 0-based epoch in progress."""
    return sana2_epoch + 1


def sana_global_step(optimizer_steps: int, gradient_accumulation_steps: int) -> int:
    """Sana's global_step counts dataloader batches of one rank (micro-batches), not optimizer steps."""
    return optimizer_steps * gradient_accumulation_steps


def folder_name(epoch: int, global_step: int) -> str:
    """`epoch_<E>_step_<S>`: Sana's resume parses E and S back out of this name."""
    return f"epoch_{epoch}_step_{global_step}"


def random_states_file(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def latest_pointer(folder: str) -> tuple[str, str]:
    """(link name, target): the symlink beside the folders that Sana's `resume_from=latest` follows.

    The target is relative to the link's directory, so the whole output can be moved.
    """
    return LATEST_LINK, folder


# -- optimizer ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """A sana2 optimizer-state tensor as stored: shape and dtype (its value is read on demand)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateTensor:
    """One tensor of the state Sana loads, computed from sana2 state tensors of the same parameter."""

    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[str, ...]  # sana2 state keys of `param`, passed to `compute` in this order
    compute: Callable[..., torch.Tensor]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    @property
    def copied(self) -> bool:
        """Whether the value is sana2's state tensor `sources[0]` itself, unchanged."""
        return self.compute is _same

    def materialize(self, read: Callable[[str, str], torch.Tensor]) -> torch.Tensor:
        """The value; `read(param, key)` returns a sana2 state tensor (it may be a reused buffer)."""
        return self.compute(*(read(self.param, key) for key in self.sources))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def full_second_moment(row: torch.Tensor, col: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The second-moment estimate CAME's factored update divides by: row col^T / mean(row), in `shape`."""
    return ((row / row.mean()).unsqueeze(1) * col.unsqueeze(0)).reshape(shape)


def _copied(param: str, key: str, stored: StoredTensor) -> StateTensor:
    return StateTensor(param, stored.shape, stored.dtype, (key,), _same)


def _sana_factors(shape: tuple[int, ...], layout: str) -> bool:
    """Whether Sana's CAMEWrapper keeps row/column moments for a parameter of `shape`.

    It factors 2-D weights and 1x1 convolutions, by the shape it is handed; under FSDP every
    parameter reaches it as a flat 1-D shard, so nothing is factored.
    """
    if layout == "fsdp":
        return False
    return len(shape) == 2 or (len(shape) == 4 and shape[2:] == (1, 1))


def param_state(name: str, stored: Mapping[str, StoredTensor], optimizer: str, layout: str) -> dict[str, Any]:
    """Sana's optimizer state of parameter `name` from its sana2 state (`stored`: key -> shape/dtype).

    AdamW: every tensor carried over as it is. CAME: see docs/sana-interop.md, "CAME". The step
    count stays sana2's 0-d tensor for both (Sana's CAME counts in a Python int, which it only
    increments; FSDP's full-state loader calls .cpu() on every state value and fails on an int).
    """
    if optimizer == "adamw":
        return {key: _copied(name, key, meta) for key, meta in stored.items()}
    if optimizer != "came":
        raise SanaLayoutError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    if "exp_avg" not in stored or "step" not in stored:
        raise SanaLayoutError(f"CAME state of {name} lacks step or exp_avg (keys: {', '.join(sorted(stored))})")
    shape = stored["exp_avg"].shape
    state: dict[str, Any] = {key: _copied(name, key, stored[key]) for key in ("step", "exp_avg")}
    sana2_factored = "exp_avg_sq_row" in stored
    if _sana_factors(shape, layout):
        if not sana2_factored:
            raise SanaLayoutError(f"CAME state of {name} {shape} is unfactored; Sana's CAME factors it")
        for key in ("exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col"):
            state[key] = _copied(name, key, stored[key])
    elif sana2_factored:
        expand = functools.partial(full_second_moment, shape=shape)
        state["exp_avg_sq"] = StateTensor(
            name, shape, stored["exp_avg_sq_row"].dtype, ("exp_avg_sq_row", "exp_avg_sq_col"), expand
        )
    else:
        state["exp_avg_sq"] = _copied(name, "exp_avg_sq", stored["exp_avg_sq"])
    return state


_SELF_ATTENTION_NORM = re.compile(r"(blocks\.\d+)\.attn\.[qk]_norm\..+")
_SELF_ATTENTION_QKV = re.compile(r"(blocks\.\d+)\.attn\.qkv\..+")


def sana_parameter_order(names: Sequence[str]) -> list[str]:
    """sana2's parameter names in the order Sana's model registers them: its optimizer's group order.

    The modules and names are the same. One difference: Sana's self-attention classes extend
    timm's Attention, which registers q_norm and k_norm right after qkv, before proj; sana2
    registers them after proj.
    """
    norms: dict[str, list[str]] = {}
    last_qkv: dict[str, str] = {}
    for name in names:
        if match := _SELF_ATTENTION_NORM.fullmatch(name):
            norms.setdefault(match.group(1), []).append(name)
        elif match := _SELF_ATTENTION_QKV.fullmatch(name):
            last_qkv[match.group(1)] = name
    ordered = []
    for name in names:
        if _SELF_ATTENTION_NORM.fullmatch(name):
            continue
        ordered.append(name)
        match = _SELF_ATTENTION_QKV.fullmatch(name)
        if match and last_qkv[match.group(1)] == name:
            ordered += norms.pop(match.group(1), [])
    if norms:
        raise SanaLayoutError(f"self-attention norms without a qkv projection: {', '.join(sorted(norms))}")
    return ordered


def optimizer_state(
    params: Sequence[tuple[str, Mapping[str, StoredTensor]]],
    group: Mapping[str, Any],
    optimizer: str,
    layout: str,
    per_parameter_groups: bool = True,
    keyed_by: str = "name",
) -> dict[str, Any]:
    """The optimizer state dict Sana loads, as a structure with `StateTensor` leaves.

    params: (name, stored state) of every parameter, in sana2's single param group's order.
    group: that group's hyperparameters (lr, initial_lr, betas, eps, weight_decay, ...).
    per_parameter_groups: one group per parameter in Sana's parameter order, as Sana's
        build_optimizer makes them (each with the same hyperparameters); False keeps one group.
    keyed_by: "name" (Accelerate FSDP's optimizer.bin, loaded by FSDP.optim_state_dict_to_load)
        or "index" (torch's Optimizer.state_dict(), what Sana's non-FSDP resume loads).
    """
    if layout not in LAYOUTS:
        raise SanaLayoutError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    if keyed_by not in ("name", "index"):
        raise SanaLayoutError(f"keyed_by must be 'name' or 'index', got {keyed_by!r}")
    by_name = dict(params)
    order = sana_parameter_order(list(by_name))
    key = {name: (name if keyed_by == "name" else index) for index, name in enumerate(order)}
    # a parameter that never had a gradient has no state (torch's optimizers leave it out too)
    state = {key[name]: param_state(name, by_name[name], optimizer, layout) for name in order if by_name[name]}
    hyper = {k: v for k, v in group.items() if k != "params" and k not in EXECUTION_OPTIONS}
    if per_parameter_groups:
        groups = [{**hyper, "params": [key[name]]} for name in order]
    else:
        groups = [{**hyper, "params": [key[name] for name in order]}]
    return {"state": state, "param_groups": groups}


def replace_state_tensors(structure: Any, fn: Callable[[StateTensor], Any]) -> Any:
    """`structure` with every StateTensor leaf replaced by fn(leaf)."""
    if isinstance(structure, StateTensor):
        return fn(structure)
    if isinstance(structure, dict):
        return {k: replace_state_tensors(v, fn) for k, v in structure.items()}
    if isinstance(structure, list):
        return [replace_state_tensors(v, fn) for v in structure]
    return structure


def materialized(structure: Any, read: Callable[[str, str], torch.Tensor]) -> Any:
    """`structure` with every StateTensor replaced by its value (each computed into new memory)."""
    return replace_state_tensors(structure, lambda leaf: leaf.materialize(read).clone())


# -- scheduler, RNG, loss scale, metadata -----------------------------------------------------------


def scheduler_state(base_lr: float, lr: float, groups: int, optimizer_steps: int, processes: int) -> dict:
    """LambdaLR.state_dict() of Sana's scheduler after `optimizer_steps` steps, for `groups` groups.

    Accelerate's scheduler wrapper steps the scheduler once per process per optimizer step (its
    batches grow with the process count), and Sana scales its warmup by the process count to
    match: so the step counter is optimizer_steps * processes of the run that resumes. lr is the
    rate of the next step (the optimizer's groups carry it too). LambdaLR keeps no lambda state
    (diffusers' schedules are plain functions): lr_lambdas holds one None per group.
    """
    if groups < 1 or processes < 1 or optimizer_steps < 0:
        raise SanaLayoutError(f"groups={groups}, processes={processes}, steps={optimizer_steps}: not a schedule")
    counter = optimizer_steps * processes
    return {
        "base_lrs": [base_lr] * groups,
        "last_epoch": counter,
        "_step_count": counter + 1,
        "_is_initial": False,
        "_get_lr_called_within_step": False,
        "_last_lr": [lr] * groups,
        "lr_lambdas": [None] * groups,
    }


def random_states(states: Mapping[str, Any], global_step: int) -> dict:
    """A rank's random_states_<rank>.pkl as Accelerate's save_state writes it.

    states: that rank's sana2 RNG states ("python", "numpy", "torch", and "cuda" on GPU runs).
    "step" is Accelerate's own counter of micro-batches, which Sana's global_step also counts.
    """
    converted = {
        "step": global_step,
        "random_state": states["python"],
        "numpy_random_seed": states["numpy"],
        "torch_manual_seed": states["torch"],
    }
    if states.get("cuda") is not None:
        converted["torch_cuda_manual_seed"] = states["cuda"]
    return converted


def scaler_state() -> dict:
    """scaler.pt for a Sana run resuming in fp16: a new loss scaler's state, as a fresh fp16 run starts.

    sana2 trains in bf16 or fp32 and keeps no loss scale; Accelerate's fp16 resume requires the
    file (FSDP's ShardedGradScaler has GradScaler's state and defaults).
    """
    return torch.amp.GradScaler("cpu").state_dict()


def metadata(epoch: int, global_step: int, scheduler: dict | None, rng: Mapping[str, Any] | None) -> dict:
    """metadata.pth beside model/, with the keys Sana's save_checkpoint_fsdp writes.

    rng: rank 0's sana2 RNG states. Sana's "generator" (the CPU generator it draws validation
    noise from) has no sana2 counterpart; rank 0's CPU generator state, of the same kind, stands in.
    """
    content: dict[str, Any] = {}
    if rng is not None:
        content["rng_state"] = {
            "torch": rng["torch"],
            "torch_cuda": list(rng.get("cuda") or []),
            "numpy": rng["numpy"],
            "python": rng["python"],
            "generator": rng["torch"].clone(),
        }
    if scheduler is not None:
        content["scheduler"] = scheduler
    content["epoch"] = epoch
    content["step"] = global_step
    return content
