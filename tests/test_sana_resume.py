"""A sana2 checkpoint, exported by sana2-convert (--format accelerate), resumes in Sana's trainer.

A sana2 run's DCP checkpoint (from FSDP2 ranks, or one process) is converted by the real converter,
then loaded through Accelerate's own loaders (load_fsdp_model, load_fsdp_optimizer,
load_accelerator_state) into an FSDP1-wrapped model and an optimizer built the way Sana builds it
(tests/sana_side.py), on 2 gloo processes, and one optimizer step runs.
"""

import copy
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.checkpointing import load_accelerator_state
from checkpoint_factory import save_single_process_run, step_folder, train_and_save_worker
from diffusers.optimization import get_constant_schedule_with_warmup
from dist_utils import run_distributed
from sana_side import (
    AcceleratorStandIn,
    FsdpPluginStandIn,
    SanaCAME,
    build_sana_optimizer,
    latest_checkpoint,
    register_like_sana,
    resume_position,
)

from sana2.components.lr_scheduler import lr_factor
from sana2.components.optimizer import build_optimizer
from sana2.config import Optimizer, load_config
from sana2.distributed.initialize import init_weights
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.models import build_model
from sana2.tools.convert_checkpoint import main as convert
from sana2.tools.export import rng_states
from sana2.tools.sana_layout import (
    METADATA_FILE,
    MODEL_DIR,
    SanaLayoutError,
    StoredTensor,
    full_second_moment,
    materialized,
    optimizer_state,
    param_state,
    sana_global_step,
    sana_parameter_order,
)

MODEL = "SanaMS_debug"
QK_NORM = dict(qk_norm=True, cross_norm=True)  # self-attention norms: Sana registers them in another order
LR, WEIGHT_DECAY, WARMUP = 1e-3, 0.01, 4
SANA_PROCESSES = 2
STEPS = 3
OPTIMIZERS = {
    "adamw": Optimizer("adamw", lr=LR, weight_decay=WEIGHT_DECAY),
    "came": Optimizer("came", lr=LR, weight_decay=WEIGHT_DECAY, betas=[0.9, 0.999, 0.9999], eps=[1e-30, 1e-16]),
}


# -- the sana2 side: a run's DCP checkpoint, exported by the converter ---------------------------------


def batch(seed: int, rows: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 4, 8, 8, generator=generator),
        torch.randint(0, 1000, (rows,), generator=generator),
        torch.randn(rows, 1, 16, 32, generator=generator),
        torch.randn(rows, 4, 8, 8, generator=generator),
    )


def train_step(model, optimizer, seed: int, rows=slice(None)) -> None:
    x, timestep, y, target = batch(seed)
    keep = torch.zeros(x[rows].shape[0], dtype=torch.bool)  # no caption dropout: the same batch on both sides
    F.mse_loss(model(x[rows], timestep[rows], y[rows], None, keep), target[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()


def run_config(overrides: dict, optimizer_name: str, *extra: str):
    """A sana2 run config for the test model, optimizer and schedule (constant after WARMUP steps)."""
    chosen = OPTIMIZERS[optimizer_name]
    options = [f"--model.name={MODEL}", *(f"--model.{k}={str(v).lower()}" for k, v in overrides.items())]
    options += [f"--optimizer.{k}={v}" for k, v in vars(chosen).items()]
    options += [f"--lr_scheduler.warmup_steps={WARMUP}", "--lr_scheduler.decay_type=constant", *extra]
    return load_config(None, [o.replace("'", '"') for o in options])


def sana2_run(tmp_path: Path, overrides: dict, optimizer_name: str, steps: int = STEPS, extra=(), **save):
    """A single-process sana2 run's step folder (as the trainer writes it) and what save_single_process_run
    returns (the full state it holds, the live model and optimizer)."""
    folder = tmp_path / "run" / f"step-{steps}"
    return folder, save_single_process_run(folder, run_config(overrides, optimizer_name, *extra), steps, **save)


def stored_params(sana2: dict) -> list[tuple[str, dict]]:
    """(name, stored state shapes) per parameter, as the export reads them from the DCP metadata."""
    state = sana2["optimizer"]["state"]
    (group,) = sana2["optimizer"]["param_groups"]
    return [
        (name, {k: StoredTensor(tuple(v.shape), v.dtype) for k, v in state[name].items()}) for name in group["params"]
    ]


def reader(sana2: dict):
    return lambda param, key: sana2["optimizer"]["state"][param][key]


def export(source: Path, out: Path, *flags: str) -> Path:
    """sana2-convert's Accelerate export; returns the folder Sana's resume_from=latest picks."""
    assert convert([str(source), str(out), "--verify", *flags]) == 0
    return latest_checkpoint(out)


# -- the Sana side, on 2 gloo processes ---------------------------------------------------------------


def sana_resume_worker(rank: int, world_size: int, folder: str, overrides: dict, optimizer_name: str, result: str):
    """Sana's FSDP resume: build, wrap, load through Accelerate, step once; rank 0 saves what it saw."""
    from accelerate.utils.fsdp_utils import load_fsdp_model, load_fsdp_optimizer
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from sana2.models.sana import SanaBlock

    model_dir = Path(folder) / MODEL_DIR
    model = register_like_sana(build_model(MODEL, **overrides))
    init_weights(model, seed=99)  # not the saved weights: they must come from the files
    # Sana's own config values: the loaded param groups replace them
    optimizer = build_sana_optimizer(model, optimizer_name, lr=0.5, weight_decay=0.5)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=WARMUP * world_size)
    # Sana's FSDP settings: transformer blocks wrapped, use_orig_params (it builds the optimizer first)
    fsdp = FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({SanaBlock}), use_orig_params=True, device_id=torch.device("cpu")
    )
    plugin, accelerator = FsdpPluginStandIn(), AcceleratorStandIn()
    load_fsdp_model(plugin, accelerator, fsdp, model_dir)
    load_fsdp_optimizer(plugin, accelerator, optimizer, fsdp, model_dir)
    scaler = torch.amp.GradScaler("cpu")
    load_accelerator_state(model_dir, [], [], [scheduler], [], rank, scaler=scaler)
    restored_rng = {"python": random.getstate(), "torch": torch.get_rng_state()}

    def full_state():
        # offload_to_cpu=False: with a CPU compute device FSDP's "offload" (.cpu()) does not copy, and
        # every gathered state of a parameter would alias the one buffer FSDP gathers them through
        with FSDP.state_dict_type(
            fsdp,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False),
        ):
            return copy.deepcopy(fsdp.state_dict()), copy.deepcopy(FSDP.optim_state_dict(fsdp, optimizer))

    loaded_model, loaded_optimizer = full_state()
    scheduled = {"last_epoch": scheduler.last_epoch, "base_lrs": scheduler.base_lrs, "last_lr": scheduler.get_last_lr()}
    # Sana's loop: this rank's rows of the global batch; Accelerate steps the scheduler once per process
    train_step(fsdp, optimizer, seed=1000, rows=slice(2 * rank, 2 * rank + 2))
    for _ in range(world_size):
        scheduler.step()
    for state in optimizer.state.values():
        # Sana's CAME keeps the RMS of this rank's shard, which differs between the ranks a parameter
        # is split over, and FSDP's full optimizer state dict refuses differing scalars. The RMS is
        # recomputed before any use at every step; it is left out of the gathered state.
        state.pop("RMS", None)
    stepped_model, stepped_optimizer = full_state()
    if rank == 0:
        torch.save(
            {
                "model": loaded_model,
                "optimizer": loaded_optimizer,
                "scheduler": scheduled,
                "next_lrs": [g["lr"] for g in optimizer.param_groups],
                "rng": restored_rng,
                "scale": scaler.get_scale(),
                "stepped_model": stepped_model,
                "stepped_optimizer": stepped_optimizer,
            },
            result,
        )


def resume_in_sana(tmp_path: Path, source: Path, overrides: dict, optimizer_name: str) -> dict:
    folder = export(source, tmp_path / "checkpoints", "--sana-processes", str(SANA_PROCESSES))
    result = tmp_path / "sana_side.pt"
    run_distributed(sana_resume_worker, SANA_PROCESSES, str(folder), overrides, optimizer_name, str(result))
    return torch.load(result, weights_only=False)


def check_resumed_run(seen: dict, sana2: dict) -> None:
    """What every resume must show: the weights, Sana's groups, the schedule, the RNG, the scale."""
    for name, tensor in sana2["model"].items():
        assert torch.equal(seen["model"][name], tensor), name
    (group,) = sana2["optimizer"]["param_groups"]
    groups = seen["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [[n] for n in sana_parameter_order(group["params"])]
    for g in groups:
        assert (g["lr"], g["initial_lr"], g["weight_decay"], tuple(g["betas"])) == (
            group["lr"],
            group["initial_lr"],
            group["weight_decay"],
            tuple(group["betas"]),
        )
    assert seen["scheduler"]["last_epoch"] == sana2["step"] * SANA_PROCESSES
    assert seen["scheduler"]["base_lrs"] == [group["initial_lr"]] * len(groups)
    assert seen["scheduler"]["last_lr"] == [group["lr"]] * len(groups)
    # the schedule goes on: the next step's lr is sana2's schedule one step further
    next_factor = lr_factor(sana2["step"] + 1, warmup_steps=WARMUP, decay="constant", total_steps=0, min_lr_ratio=0)
    assert seen["next_lrs"] == pytest.approx([group["initial_lr"] * next_factor] * len(groups))
    assert seen["rng"]["python"] == sana2["rng"][0]["python"]
    assert torch.equal(seen["rng"]["torch"], sana2["rng"][0]["torch"])
    assert seen["scale"] == 65536.0


def sana2_next_step(sana2: dict, optimizer_name: str) -> dict:
    """sana2's own next step from the same state and the same global batch (what a resumed run must do)."""
    model = build_model(MODEL)
    model.load_state_dict(sana2["model"])
    optimizer = build_optimizer(model, OPTIMIZERS[optimizer_name])
    names = [n for n, _ in model.named_parameters()]
    (group,) = sana2["optimizer"]["param_groups"]
    state = {i: sana2["optimizer"]["state"][n] for i, n in enumerate(names)}
    optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": list(range(len(names)))}]})
    train_step(model, optimizer, seed=1000)
    return model.state_dict()


@pytest.mark.slow
def test_adamw_checkpoint_resumes_in_sana_under_accelerate_fsdp_exactly(tmp_path):
    # the trainer's FSDP2 run on 2 ranks: the converter streams its DCP checkpoint into Sana's layout
    run_distributed(train_and_save_worker, 2, str(tmp_path / "run"), STEPS, False, str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    source = step_folder(tmp_path / "run", STEPS)
    sana2 = {
        "model": full["model"],
        "optimizer": full["optimizer"],
        "step": STEPS,
        "rng": rng_states(DcpCheckpoint(source)),
    }
    seen = resume_in_sana(tmp_path, source, {}, "adamw")

    check_resumed_run(seen, sana2)
    for name, state in sana2["optimizer"]["state"].items():
        assert seen["optimizer"]["state"][name].keys() == state.keys(), name
        for key, value in state.items():
            assert torch.equal(seen["optimizer"]["state"][name][key], value), f"{name}.{key}"
    # Sana's first step after the resume is the step sana2 itself would have taken
    expected = sana2_next_step(sana2, "adamw")
    for name, value in expected.items():
        stepped = seen["stepped_model"][name]
        if name.endswith("cross_attn.kv_linear.bias"):
            # softmax ignores a bias added to every key, so the key half's gradient is rounding noise,
            # which AdamW scales up to steps of order lr: the two runs' noise differs. The values agree.
            keys = value.shape[0] // 2
            assert (stepped[:keys] - value[:keys]).abs().max() < LR, name
            stepped, value = stepped[keys:], value[keys:]
        torch.testing.assert_close(stepped, value, atol=1e-6, rtol=0, msg=name)


@pytest.mark.slow
def test_came_checkpoint_resumes_in_sana_camewrapper_under_accelerate_fsdp(tmp_path):
    source, saved = sana2_run(tmp_path, QK_NORM, "came")
    sana2 = saved["full"]
    seen = resume_in_sana(tmp_path, source, QK_NORM, "came")

    check_resumed_run(seen, sana2)
    for name, state in sana2["optimizer"]["state"].items():
        loaded = seen["optimizer"]["state"][name]
        # Sana's CAME under FSDP sees flat shards: one full-shape second moment, no instability stats
        assert set(loaded) == {"step", "exp_avg", "exp_avg_sq"}, name
        assert torch.equal(loaded["step"], state["step"]), name
        assert torch.equal(loaded["exp_avg"], state["exp_avg"]), name
        if "exp_avg_sq_row" in state:
            expected = full_second_moment(
                state["exp_avg_sq_row"], state["exp_avg_sq_col"], tuple(state["exp_avg"].shape)
            )
        else:
            expected = state["exp_avg_sq"]
        assert torch.equal(loaded["exp_avg_sq"], expected), name
    for name, state in seen["stepped_optimizer"]["state"].items():
        assert state["step"].item() == STEPS + 1, name
    for name, value in seen["stepped_model"].items():
        if name in dict(build_model(MODEL, **QK_NORM).named_parameters()):
            assert torch.isfinite(value).all() and not torch.equal(value, sana2["model"][name]), name


# -- single-process checks --------------------------------------------------------------------------


def test_came_without_fsdp_resumes_exactly_where_sana_factors_as_sana2_does(tmp_path):
    """Sana's CAMEWrapper on full-shape parameters (its DDP resume, index-keyed state) factors 2-D
    weights and 1x1 convolutions as sana2 does: those and the 1-D parameters step exactly as sana2
    would; the 3x3 depthwise convolutions get the expanded second moment and Sana's unfactored rule."""
    _, saved = sana2_run(tmp_path, QK_NORM, "came")
    sana2, model, optimizer = saved["full"], saved["model"], saved["optimizer"]
    (group,) = sana2["optimizer"]["param_groups"]
    structure = optimizer_state(stored_params(sana2), group, "came", layout="unsharded", keyed_by="index")
    sana_model = register_like_sana(build_model(MODEL, **QK_NORM))
    sana_model.load_state_dict(sana2["model"])
    sana_optimizer = build_sana_optimizer(sana_model, "came", lr=0.5, weight_decay=0.5)
    sana_optimizer.load_state_dict(materialized(structure, reader(sana2)))
    assert all(
        (g["lr"], g["weight_decay"]) == (group["lr"], group["weight_decay"]) for g in sana_optimizer.param_groups
    )

    train_step(model, optimizer, seed=1000)
    train_step(sana_model, sana_optimizer, seed=1000)
    ours, theirs = dict(model.named_parameters()), dict(sana_model.named_parameters())
    approximated = {n for n, p in ours.items() if SanaCAME.factored(p.shape) != (p.dim() >= 2)}
    assert approximated == {f"blocks.{i}.mlp.depth_conv.conv.weight" for i in range(2)}
    for name, parameter in ours.items():
        if name in approximated:
            assert torch.isfinite(theirs[name]).all()
        else:
            torch.testing.assert_close(theirs[name], parameter, atol=1e-6, rtol=0, msg=name)


def test_accelerate_load_state_restores_schedule_rng_and_scale_from_the_export(tmp_path):
    source, saved = sana2_run(tmp_path, {}, "adamw", steps=1, ranks=SANA_PROCESSES)
    folder = export(source, tmp_path / "checkpoints")  # the run's 2 ranks: Sana's schedule for 2 processes
    model = build_model(MODEL)
    optimizer = build_sana_optimizer(model, "adamw", lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=WARMUP * SANA_PROCESSES)
    scaler = torch.amp.GradScaler("cpu")
    PartialState(cpu=True)  # Accelerate's loaders log through its process state
    load_accelerator_state(folder / MODEL_DIR, [], [], [scheduler], [], 1, scaler=scaler)  # as rank 1
    assert scheduler.last_epoch == 1 * SANA_PROCESSES
    assert scheduler.base_lrs == [LR] * len(optimizer.param_groups)
    assert random.getstate() == saved["full"]["rng"][1]["python"]
    assert torch.equal(torch.get_rng_state(), saved["full"]["rng"][1]["torch"])
    assert scaler.get_scale() == 65536.0
    for _ in range(SANA_PROCESSES):
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(LR * 2 / WARMUP)  # sana2's lr at step 2


@pytest.mark.slow
def test_export_folder_counts_epochs_from_1_and_micro_batches_and_latest_points_at_it(tmp_path):
    gradient_accumulation = ["--training.gradient_accumulation_steps=4"]
    source, _ = sana2_run(tmp_path, {}, "adamw", steps=3, extra=gradient_accumulation, epoch=2)
    out = tmp_path / "checkpoints"
    folder = export(source, out)
    assert folder == (out / "epoch_3_step_12").resolve()  # sana2's epoch 2 is Sana's 3rd; 3 steps x 4 batches
    assert (out / "epoch_3_step_12.pth").is_file()
    assert resume_position(latest_checkpoint(out)) == (2, 12)  # Sana restarts epoch 3 at step 12
    assert sana_global_step(3, gradient_accumulation_steps=4) == 12
    saved = torch.load(folder / METADATA_FILE, weights_only=False)
    assert list(saved) == ["rng_state", "scheduler", "epoch", "step"]
    assert (saved["epoch"], saved["step"]) == (3, 12)
    assert set(saved["rng_state"]) == {"torch", "torch_cuda", "numpy", "python", "generator"}
    torch.Generator().set_state(saved["rng_state"]["generator"])  # Sana's non-FSDP resume does this
    states = torch.load(folder / MODEL_DIR / "random_states_0.pkl", weights_only=False)
    assert states["step"] == 12  # Accelerate's own micro-batch counter

    # a later export moves the pointer, as Sana's next save does; a real file there is never replaced
    later, _ = sana2_run(tmp_path / "later", {}, "adamw", steps=5, extra=gradient_accumulation, epoch=2)
    assert export(later, out) == (out / "epoch_3_step_20").resolve()
    assert (out / "epoch_3_step_12").is_dir()
    (out / "latest.pth").unlink()
    (out / "latest.pth").write_bytes(b"not a link")
    assert convert([str(source), str(out), "--overwrite"]) == 2


def test_single_param_group_option_keeps_one_group_in_sana_order(tmp_path):
    source, saved = sana2_run(tmp_path, QK_NORM, "adamw", steps=1)
    folder = export(source, tmp_path / "checkpoints", "--single-param-group")
    optimizer = torch.load(folder / MODEL_DIR / "optimizer.bin", weights_only=True)
    (group,) = saved["full"]["optimizer"]["param_groups"]
    (single,) = optimizer["param_groups"]
    assert single["params"] == sana_parameter_order(group["params"]) != group["params"]
    assert "foreach" in group and "foreach" not in single  # Sana's run picks its own implementation
    assert single["lr"] == group["lr"]
    scheduler = torch.load(folder / MODEL_DIR / "scheduler.bin", weights_only=True)
    assert scheduler["base_lrs"] == [group["initial_lr"]] and scheduler["lr_lambdas"] == [None]


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("SanaMS_debug", QK_NORM),
        ("SanaMS_debug", dict(attn_type="flash", qk_norm=True)),  # qkv bias and LayerNorm q/k norms
        ("SanaMSVideo", dict(depth=2, hidden_size=64, num_heads=2, linear_head_dim=32, in_channels=4)),
    ],
)
def test_parameter_order_is_the_order_sana_registers_parameters(name, overrides):
    with torch.device("meta"):
        ours = [n for n, _ in build_model(name, **overrides).named_parameters()]
        sanas = [n for n, _ in register_like_sana(build_model(name, **overrides)).named_parameters()]
    assert ours != sanas
    assert sana_parameter_order(ours) == sanas


def test_came_state_that_cannot_be_laid_out_raises_naming_the_parameter():
    matrix = StoredTensor((8, 4), torch.float32)
    stored = {"step": StoredTensor((), torch.float32), "exp_avg": matrix, "exp_avg_sq": matrix}
    with pytest.raises(SanaLayoutError, match="blocks.0.attn.proj.weight"):
        param_state("blocks.0.attn.proj.weight", stored, "came", "unsharded")
    with pytest.raises(SanaLayoutError, match="lacks step or exp_avg"):
        param_state("x", {"exp_avg_sq": matrix}, "came", "fsdp")
    with pytest.raises(SanaLayoutError, match="unknown layout"):
        optimizer_state([], {}, "came", "ddp")
