"""The model-transform step: configured transforms between the build on meta and parallelisation, and what
trains after them is what the optimizer steps, EMA averages and checkpoints save."""

import subprocess
import sys

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from train_utils import full_model_state, run_steps, tiny_config

from sana2.components.ema import EMA
from sana2.components.model_transforms import (
    TRANSFORMS,
    Freeze,
    apply_transforms,
    build_transforms,
    frozen_parameter_names,
    register_transform,
    trainable_parameters,
)
from sana2.components.optimizer import build_optimizer
from sana2.config import ConfigError, Optimizer, load_config
from sana2.models import build_model

FREEZE = ['--model_transforms.names=["freeze"]', '--model_transforms.freeze=["blocks.0.*", "x_embedder.*"]']


def tiny_model(device="cpu") -> nn.Module:
    with torch.device(device):
        return build_model("SanaMS_digits", depth=2, hidden_size=64, num_heads=2)


@pytest.mark.slow
def test_the_memory_plan_of_a_lora_config_works_in_a_process_that_never_imported_the_trainer():
    # The plan (like any builder of the model) must find sana2's own transforms without importing sana2.train;
    # a fresh interpreter, because this test process may have imported sana2.components.lora already.
    code = (
        "from sana2.config import load_config; from sana2.plan import make_memory_plan; "
        "config = load_config(None, ['--model_transforms.names=[\"lora\"]']); "
        "print(make_memory_plan(config, 2, device='cpu').estimate.peak > 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_transforms_are_built_from_the_config_by_name_and_unknown_names_are_config_errors():
    assert build_transforms(load_config(None, [])) == []
    (freeze,) = build_transforms(load_config(None, FREEZE))
    assert isinstance(freeze, Freeze) and freeze.patterns == ["blocks.0.*", "x_embedder.*"]
    with pytest.raises(ConfigError, match=r"model_transforms.names: unknown transform 'float8'; registered: .*freeze"):
        build_transforms(load_config(None, ['--model_transforms.names=["float8"]']))
    with pytest.raises(ConfigError, match="model_transforms.freeze names no parameter"):
        build_transforms(load_config(None, ['--model_transforms.names=["freeze"]']))


def test_transforms_apply_in_order_on_meta_and_a_new_one_registers_by_name():
    applied = []

    class Record:
        def __init__(self, tag):
            self.tag = tag

        def apply(self, model):
            applied.append(self.tag)
            return model

    register_transform("test-record")(lambda config: Record(config.model_transforms.freeze[0]))
    try:
        config = load_config(None, ['--model_transforms.names=["test-record", "freeze"]', FREEZE[1]])
        model = apply_transforms(tiny_model("meta"), build_transforms(config))
        assert applied == ["blocks.0.*"]
        with pytest.raises(ValueError, match="'test-record' is registered already"):
            register_transform("test-record")(Record)
    finally:
        del TRANSFORMS["test-record"]
    frozen = frozen_parameter_names(model)
    assert frozen and all(name.startswith(("blocks.0.", "x_embedder.")) for name in frozen)
    assert set(trainable_parameters(model)) == {n for n, _ in model.named_parameters()} - set(frozen)


def test_freeze_names_what_matches_nothing_and_refuses_to_freeze_everything():
    with pytest.raises(ValueError, match="'blocks.9.*' matches no parameter"):
        Freeze(["blocks.9.*"]).apply(tiny_model("meta"))
    with pytest.raises(ValueError, match="every parameter is frozen"):
        Freeze(["*"]).apply(tiny_model("meta"))


def test_the_optimizer_and_ema_hold_only_what_trains():
    model = Freeze(["blocks.0.*"]).apply(tiny_model())
    trainable = trainable_parameters(model)
    optimizer = build_optimizer(model, Optimizer(name="adamw"))
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in trainable.values()}
    ema = EMA(model, 0.9)
    assert set(ema.shadow) == set(trainable) and not any(name.startswith("blocks.0.") for name in ema.shadow)


def _train_stop_and_resume(rank, world_size, dump, out_file):
    from sana2.train import Trainer

    run = [*FREEZE, "--checkpoint.enable=true", "--training.steps=4", "--training.ema_decay=0.9"]
    straight = Trainer(tiny_config(dump / "straight", *run))
    start = full_model_state(straight.model)
    straight_losses = run_steps(straight, 4)
    end = full_model_state(straight.model)
    stopped = Trainer(tiny_config(dump / "stopped", *run))
    losses = run_steps(stopped, 2)
    stopped.save_checkpoint(final=True)
    del stopped
    resumed = Trainer(tiny_config(dump / "stopped", *run))
    losses += run_steps(resumed, 2)
    resumed_end = full_model_state(resumed.model)
    frozen = frozen_parameter_names(resumed.model)
    if rank == 0:
        torch.save(
            {
                "frozen": frozen,
                "trainable": list(trainable_parameters(resumed.model)),
                "start": start,
                "end": end,
                "straight": straight_losses,
                "resumed": losses,
                "resumed_end": resumed_end,
            },
            out_file,
        )


@pytest.mark.slow
def test_frozen_parameters_do_not_train_are_not_checkpointed_and_a_resume_is_exact(tmp_path):
    run_distributed(_train_stop_and_resume, 2, tmp_path, tmp_path / "result.pt")
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    frozen = result["frozen"]
    assert frozen and all(name.startswith(("blocks.0.", "x_embedder.")) for name in frozen)
    changed = {name for name in result["start"] if not torch.equal(result["start"][name], result["end"][name])}
    assert not changed & set(frozen)  # frozen parameters keep their initial values
    assert len(changed & set(result["trainable"])) > 0.9 * len(result["trainable"])  # the others train
    assert result["resumed"] == result["straight"]  # exact floats
    for name, tensor in result["end"].items():
        assert torch.equal(result["resumed_end"][name], tensor), name
    # the checkpoint holds the trained parameters, their EMA and optimizer state, and no frozen parameter
    dcp_to_torch_save(tmp_path / "stopped" / "checkpoint" / "step-2", tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    model_keys, ema_keys = set(saved["model"]), set(saved["ema"])
    assert set(result["trainable"]) <= model_keys and not set(frozen) & model_keys
    assert ema_keys == set(result["trainable"])
