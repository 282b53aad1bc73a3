"""sana2-convert: DCP training checkpoints <-> the reference's files, bit-exact and one tensor at a time."""

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoint_factory import (
    load_model_state_worker,
    reshard_worker,
    save_single_process_run,
    step_folder,
    train_and_save_worker,
)
from dist_utils import run_distributed
from safetensors.torch import load_file
from train_utils import TINY

from sana2 import staging
from sana2.config import load_config
from sana2.formats import torch_file
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.tensors import SourceTensor
from sana2.models import build_model
from sana2.tools import convert_checkpoint, export
from sana2.tools.convert_checkpoint import main
from sana2.tools.export import plan_export
from sana2.tools.progress import progress_bar, tracked
from sana2.tools.sana_layout import EXECUTION_OPTIONS, sana_parameter_order
from sana2.tools.verify import VerificationFailed, verify_pth

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 2-rank FSDP2 run's checkpoint (with EMA), its full state, and the same state saved at 4 and 1 ranks."""
    root = tmp_path_factory.mktemp("convert")
    run_distributed(train_and_save_worker, 2, str(root / "w2"), 2, True, str(root / "full.pt"))
    w2 = step_folder(root / "w2", 2)
    run_distributed(reshard_worker, 4, str(w2), str(root / "w4"), True)
    run_distributed(reshard_worker, 1, str(w2), str(root / "w1"), True)
    return SimpleNamespace(
        root=root,
        w2=w2,
        w4=step_folder(root / "w4", 2),
        w1=step_folder(root / "w1", 2),
        full=torch.load(root / "full.pt", weights_only=True),
    )


def convert(*args) -> int:
    return main([str(arg) for arg in args])


def assert_same_bits(got: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, name
    assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


def assert_same_state(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert_same_bits(got[name], tensor, name)


def load_safetensors_folder(folder: Path) -> dict:
    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    merged = {}
    for name in files:
        merged.update(load_file(folder / name))
    return merged


# -- DCP -> files -----------------------------------------------------------------------------
@pytest.mark.slow
def test_accelerate_export_equals_the_training_full_state_dict_bit_for_bit(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out", "--verify") == 0
    folder = tmp_path / "out" / "epoch_2_step_2"
    model = torch.load(folder / "model" / "pytorch_model_fsdp.bin", weights_only=True)
    assert_same_state(model, runs.full["model"])
    wrapped = torch.load(tmp_path / "out" / "epoch_2_step_2.pth", weights_only=True, mmap=True)
    assert list(wrapped) == ["state_dict"]
    assert_same_state(wrapped["state_dict"], runs.full["model"])


@pytest.mark.slow
def test_accelerate_optimizer_bin_holds_the_full_optimizer_state_in_sanas_param_groups(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out") == 0
    model_dir = tmp_path / "out" / "epoch_2_step_2" / "model"
    optimizer = torch.load(model_dir / "optimizer.bin", weights_only=True)
    expected = runs.full["optimizer"]
    (group,) = expected["param_groups"]
    order = sana_parameter_order(group["params"])  # the order Sana's model registers its parameters in
    assert [g["params"] for g in optimizer["param_groups"]] == [[name] for name in order]
    hyperparameters = {k: v for k, v in group.items() if k not in ("params", *EXECUTION_OPTIONS)}
    assert all({k: g[k] for k in g if k != "params"} == hyperparameters for g in optimizer["param_groups"])
    assert list(optimizer["state"]) == order
    for name, state in expected["state"].items():
        assert optimizer["state"][name].keys() == state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for field, tensor in state.items():
            assert_same_bits(optimizer["state"][name][field], tensor, f"{name}.{field}")


@pytest.mark.slow
def test_accelerate_scheduler_rng_scaler_metadata_and_latest_files(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out") == 0
    folder = tmp_path / "out" / "epoch_2_step_2"  # the factory's run is in its epoch 1 (from 0): Sana's 2nd
    assert (tmp_path / "out" / "latest.pth").resolve() == folder
    groups = len(torch.load(folder / "model" / "optimizer.bin", weights_only=True)["param_groups"])
    scheduler = torch.load(folder / "model" / "scheduler.bin", weights_only=True)
    saved = runs.full["scheduler"]
    assert scheduler["last_epoch"] == 2 * 2  # 2 steps, stepped once per process of a 2-process Sana run
    assert scheduler["base_lrs"] == saved["base_lrs"] * groups and scheduler["lr_lambdas"] == [None] * groups
    assert scheduler["_last_lr"] == saved["_last_lr"] * groups
    for rank in (0, 1):
        states = torch.load(folder / "model" / f"random_states_{rank}.pkl", weights_only=False)
        assert set(states) == {"step", "random_state", "numpy_random_seed", "torch_manual_seed"}
        assert states["step"] == 2 and states["torch_manual_seed"].dtype == torch.uint8
    assert torch.load(folder / "model" / "scaler.pt", weights_only=True)["scale"] == 65536.0
    metadata = torch.load(folder / "metadata.pth", weights_only=False)
    assert (metadata["step"], metadata["epoch"]) == (2, 2)
    assert metadata["scheduler"] == scheduler
    assert set(metadata["rng_state"]) == {"torch", "torch_cuda", "numpy", "python", "generator"}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_cuda_rng_states_become_accelerate_torch_cuda_manual_seed(tmp_path):
    """A GPU run's rank saves its CUDA generator states as a list: Accelerate keeps them under its own key."""
    import random

    import numpy as np
    import torch.distributed.checkpoint as dcp

    cuda_states = [torch.randint(0, 255, (16,), dtype=torch.uint8) for _ in range(2)]
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda_states,
    }
    folder = tmp_path / "step-3"
    dcp.save(
        {
            "model": {"w": torch.ones(2)},
            "train_state": {"step": 3, "epoch": 0, "skipped_steps": 0},
            "rng": {"rank0": rng},
        },
        checkpoint_id=folder,
        no_dist=True,
    )
    (folder / "COMPLETE").write_text(json.dumps({"step": 3, "world_size": 1}))
    assert convert(folder, tmp_path / "out", "--verify") == 0
    states = torch.load(tmp_path / "out" / "epoch_1_step_3" / "model" / "random_states_0.pkl", weights_only=False)
    assert len(states["torch_cuda_manual_seed"]) == 2
    for got, expected in zip(states["torch_cuda_manual_seed"], cuda_states):
        assert_same_bits(got, expected)
    metadata = torch.load(tmp_path / "out" / "epoch_1_step_3" / "metadata.pth", weights_only=False)
    assert_same_bits(metadata["rng_state"]["torch_cuda"][1], cuda_states[1])


@pytest.mark.slow
def test_reference_loader_path_loads_the_exports_into_sana2_model_with_exact_keys(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out") == 0
    out = tmp_path / "out"
    for path in (out / "epoch_2_step_2.pth", out / "epoch_2_step_2" / "model" / "pytorch_model_fsdp.bin"):
        state_dict = torch.load(path, map_location="cpu")
        state_dict = state_dict.get("state_dict", state_dict)
        model = build_model("SanaMS_debug")
        model.load_state_dict(state_dict, strict=True)  # every key, no extras
        del state_dict["pos_embed"]  # what the reference's loader does before load_state_dict(strict=False)
        missing, unexpected = build_model("SanaMS_debug").load_state_dict(state_dict, strict=False)
        assert (missing, unexpected) == (["pos_embed"], [])
        assert_same_state(model.state_dict(), runs.full["model"])


@pytest.mark.slow
def test_model_only_writes_no_optimizer_scheduler_or_rng_files(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out", "--model-only", "--verify") == 0
    model_dir = tmp_path / "out" / "epoch_2_step_2" / "model"
    assert sorted(p.name for p in model_dir.iterdir()) == ["pytorch_model_fsdp.bin"]
    assert torch.load(model_dir.parent / "metadata.pth", weights_only=True) == {"step": 2, "epoch": 2}
    assert not (model_dir.parent.parent / "latest.pth").exists()  # nothing to resume training from


@pytest.mark.slow
def test_pth_export_equals_the_training_full_state_dict(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "model.pth", "--format", "pth", "--verify") == 0
    assert_same_state(torch.load(tmp_path / "model.pth", weights_only=True)["state_dict"], runs.full["model"])


@pytest.mark.parametrize("layout", ["file", "folder", "shards"])
@pytest.mark.slow
def test_safetensors_export_equals_the_training_full_state_dict(runs, tmp_path, layout):
    output = tmp_path / ("model.safetensors" if layout == "file" else "model")
    extra = ["--max-shard-size", "100KB"] if layout == "shards" else []
    assert convert(runs.w2, output, "--format", "safetensors", "--verify", *extra) == 0
    if layout == "file":
        exported = load_file(output)
    else:
        shards = sorted(p.name for p in output.glob("*.safetensors"))
        assert (len(shards) > 1) == (layout == "shards")
        exported = load_safetensors_folder(output)
    assert exported.keys() == runs.full["model"].keys()
    for name, tensor in runs.full["model"].items():
        assert_same_bits(exported[name], tensor, name)


@pytest.mark.slow
def test_safetensors_metadata_records_step_and_format(runs, tmp_path):
    from safetensors import safe_open

    assert convert(runs.w2, tmp_path / "m.safetensors", "--format", "safetensors", "--ema") == 0
    with safe_open(tmp_path / "m.safetensors", "pt") as file:
        assert {"format": "pt", "step": "2", "weights": "ema"}.items() <= file.metadata().items()


@pytest.mark.parametrize("form", ["pth", "safetensors"])
@pytest.mark.slow
def test_bf16_export_equals_the_cast_of_the_fp32_weights(runs, tmp_path, form):
    output = tmp_path / ("m.pth" if form == "pth" else "m.safetensors")
    assert convert(runs.w2, output, "--format", form, "--dtype", "bf16", "--verify") == 0
    exported = torch.load(output, weights_only=True)["state_dict"] if form == "pth" else load_file(output)
    for name, tensor in runs.full["model"].items():
        assert_same_bits(exported[name], tensor.to(torch.bfloat16), name)


@pytest.mark.slow
def test_bf16_export_keeps_optimizer_states_in_fp32(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "out", "--dtype", "bf16") == 0
    optimizer = torch.load(tmp_path / "out" / "epoch_2_step_2" / "model" / "optimizer.bin", weights_only=True)
    assert {t.dtype for state in optimizer["state"].values() for t in state.values()} == {torch.float32}


@pytest.mark.slow
def test_ema_export_takes_ema_weights_and_the_model_buffers(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "ema.pth", "--format", "pth", "--ema", "--verify") == 0
    exported = torch.load(tmp_path / "ema.pth", weights_only=True)["state_dict"]
    assert list(exported) == list(runs.full["model"])
    for name, tensor in exported.items():
        expected = runs.full["ema"].get(name, runs.full["model"][name])
        assert_same_bits(tensor, expected, name)
    assert not torch.equal(exported["blocks.0.attn.qkv.weight"], runs.full["model"]["blocks.0.attn.qkv.weight"])


def _all_tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _all_tensors(value, f"{prefix}.{key}").items()}
    if isinstance(obj, list):
        return {k: v for i, value in enumerate(obj) for k, v in _all_tensors(value, f"{prefix}[{i}]").items()}
    return {}


@pytest.mark.slow
def test_same_state_saved_at_world_size_4_and_1_converts_to_identical_tensors(runs, tmp_path):
    outputs = {}
    for name, folder in (("w4", runs.w4), ("w1", runs.w1), ("w2", runs.w2)):
        assert json.loads((folder / "COMPLETE").read_text())["world_size"] == int(name[1])
        assert convert(folder, tmp_path / name) == 0
        model_dir = tmp_path / name / "epoch_2_step_2" / "model"
        outputs[name] = {
            file: _all_tensors(torch.load(model_dir / file, weights_only=True))
            for file in ("pytorch_model_fsdp.bin", "optimizer.bin")
        }
        assert convert(folder, tmp_path / f"{name}.safetensors", "--format", "safetensors", "--ema") == 0
        outputs[name]["ema"] = load_file(tmp_path / f"{name}.safetensors")
    for file, tensors in outputs["w4"].items():
        assert tensors.keys() == outputs["w1"][file].keys() == outputs["w2"][file].keys()
        for key, tensor in tensors.items():
            assert_same_bits(outputs["w1"][file][key], tensor, f"{file}{key}")
            assert_same_bits(outputs["w2"][file][key], tensor, f"{file}{key}")


# -- files -> DCP -----------------------------------------------------------------------------
@pytest.mark.slow
def test_to_dcp_round_trip_loads_into_a_sharded_model(runs, tmp_path):
    assert convert(runs.w2, tmp_path / "model.pth", "--format", "pth") == 0
    dcp_folder = step_folder(tmp_path / "imported", 0)
    assert convert("--to-dcp", tmp_path / "model.pth", dcp_folder, "--verify") == 0
    marker = json.loads((dcp_folder / "COMPLETE").read_text())  # the trainer's marker, as its saves write it
    assert marker.keys() == {"step", "sequence", "world_size", "checksums", "time"}
    assert (marker["step"], marker["sequence"], marker["world_size"], marker["checksums"]) == (0, 1, 1, True)
    assert (dcp_folder / "config.json").is_file() and (dcp_folder / "__0_0.distcp").is_file()
    assert (dcp_folder / "__0_0.distcp.crc32.json").is_file()  # the trainer's CRC32 list, as its saves write it
    run_distributed(load_model_state_worker, 2, str(dcp_folder), str(tmp_path / "loaded.pt"))
    assert_same_state(torch.load(tmp_path / "loaded.pt", weights_only=True), runs.full["model"])
    # every field the trainer's TrainState saves, so a resume from it restores them all
    train_state = {"step": 0, "epoch": 0, "skipped_steps": 0, "consecutive_nonfinite": 0}
    assert DcpCheckpoint(dcp_folder).nested("train_state") == train_state
    assert convert(dcp_folder, tmp_path / "back.pth", "--format", "pth") == 0
    assert_same_state(torch.load(tmp_path / "back.pth", weights_only=True)["state_dict"], runs.full["model"])


@pytest.mark.parametrize(
    "source",
    [
        "accelerate_bin",
        "accelerate_model_folder",
        "plain_state_dict",
        "ddp_prefixed",
        "legacy_torch_file",
        "safetensors_file",
        "safetensors_shards",
    ],
)
@pytest.mark.slow
def test_to_dcp_accepts_each_full_checkpoint_format(runs, tmp_path, source):
    if source.startswith("accelerate"):
        assert convert(runs.w2, tmp_path / "acc", "--model-only") == 0
        path = tmp_path / "acc" / "epoch_2_step_2" / "model"
        path = path / "pytorch_model_fsdp.bin" if source == "accelerate_bin" else path
    elif source == "plain_state_dict":
        path = tmp_path / "plain.pt"
        torch.save(runs.full["model"], path)
    elif source == "ddp_prefixed":
        path = tmp_path / "ddp.pt"
        torch.save({f"module.{k}": v for k, v in runs.full["model"].items()}, path)
    elif source == "legacy_torch_file":
        path = tmp_path / "legacy.pt"
        torch.save({"state_dict": runs.full["model"]}, path, _use_new_zipfile_serialization=False)
    elif source == "safetensors_file":
        path = tmp_path / "m.safetensors"
        assert convert(runs.w2, path, "--format", "safetensors") == 0
    else:
        path = tmp_path / "shards"
        assert convert(runs.w2, path, "--format", "safetensors", "--max-shard-size", "100KB") == 0
    assert convert("--to-dcp", path, tmp_path / "dcp", "--verify") == 0
    model = {name: tensor.read() for name, tensor in DcpCheckpoint(tmp_path / "dcp").nested("model").items()}
    assert "pos_embed" in model  # kept: initial load ignores it, an export gives it back
    assert model.keys() == runs.full["model"].keys()
    for name, tensor in runs.full["model"].items():
        assert_same_bits(model[name], tensor, name)


# -- errors -----------------------------------------------------------------------------------
def _flip_a_byte_in_the_data_of(path: Path, values: torch.Tensor, begin: int = 0, end: int | None = None) -> None:
    """Flip one bit inside the stored bytes of `values` in `path` (what bit rot does), searched within [begin, end)."""
    data = bytearray(path.read_bytes())
    offset = data.find(values.contiguous().reshape(-1).view(torch.uint8)[:64].numpy().tobytes(), begin, end)
    assert offset >= 0, f"the values are not stored in {path}"
    data[offset + 12] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_a_byte_of(folder: Path, key: str, shard: str, full: torch.Tensor) -> None:
    """Flip one bit inside the tensor data of `key`'s chunk in `shard` (the chunk's rows of `full`)."""
    metadata = DcpCheckpoint(folder).metadata
    index, info = next(
        (index, info)
        for index, info in metadata.storage_data.items()
        if index.fqn == key and info.relative_path == shard
    )
    rows = full[index.offset[0] :]
    _flip_a_byte_in_the_data_of(folder / shard, rows, info.offset, info.offset + info.length)


@pytest.mark.parametrize("made_by", ["trainer", "to_dcp"])
@pytest.mark.slow
def test_a_flipped_byte_in_a_shard_fails_the_conversion_naming_the_shard_and_the_key(runs, tmp_path, capsys, made_by):
    if made_by == "trainer":
        source, shard = tmp_path / "step-2", "__1_0.distcp"
        shutil.copytree(runs.w2, source)
    else:
        torch.save({"state_dict": runs.full["model"]}, tmp_path / "model.pth")
        source, shard = tmp_path / "imported", "__0_0.distcp"
        assert convert("--to-dcp", tmp_path / "model.pth", source) == 0
    assert (source / f"{shard}.crc32.json").is_file()
    key = "model.blocks.1.attn.qkv.weight"
    _flip_a_byte_of(source, key, shard, runs.full["model"]["blocks.1.attn.qkv.weight"])
    capsys.readouterr()
    for form, output in (("pth", tmp_path / "out.pth"), ("safetensors", tmp_path / "out.safetensors")):
        assert convert(source, output, "--format", form, "--verify") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"checkpoint shard {source / shard} is corrupt: the bytes of {key}" in err, err
        assert not output.exists()


@pytest.mark.parametrize("content", ["other objects", "not a checkpoint"])
def test_a_non_checkpoint_input_is_one_line_naming_the_file_without_torchs_advice(tmp_path, capsys, content):
    path = tmp_path / "model.pth"
    if content == "other objects":
        torch.save({"state_dict": {"w": torch.ones(1)}, "args": Path("x")}, path)
    else:
        path.write_text("notes, not a model\n")
    assert convert("--to-dcp", path, tmp_path / "imported" / "step-0") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sana2-convert: error: cannot read {path}: expected a ") and err.count("\n") == 1, err
    assert "weights_only" not in err and "Re-running" not in err
    assert list(tmp_path.iterdir()) == [path]  # not even the output's parent folder


@pytest.mark.slow
def test_a_missing_checksum_list_fails_when_the_marker_says_it_was_written(runs, tmp_path, capsys):
    source = tmp_path / "step-2"
    shutil.copytree(runs.w2, source)
    (source / "__0_0.distcp.crc32.json").unlink()
    assert convert(source, tmp_path / "out.pth", "--format", "pth") == 2
    assert f"checksum file {source / '__0_0.distcp.crc32.json'} is missing" in capsys.readouterr().err


def _damage(kind: str, folder: Path) -> None:
    if kind == "no_metadata":
        (folder / ".metadata").unlink()
    elif kind == "no_complete":
        (folder / "COMPLETE").unlink()
    elif kind == "missing_shard":
        (folder / "__1_0.distcp").unlink()
    elif kind == "truncated_shard":
        data = (folder / "__1_0.distcp").read_bytes()
        (folder / "__1_0.distcp").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "kind, message",
    [
        ("not_a_folder", "is not a folder"),
        ("no_metadata", ".metadata is missing"),
        ("no_complete", "no COMPLETE marker"),
        ("missing_shard", "__1_0.distcp is missing"),
        ("truncated_shard", "__1_0.distcp is truncated"),
        ("output_exists", "refusing to replace"),
        ("ema_without_ema", "has no EMA weights"),
    ],
)
@pytest.mark.slow
def test_errors_are_one_line_with_nonzero_exit(runs, tmp_path, capsys, kind, message):
    source = tmp_path / "step-2"
    shutil.copytree(runs.w2, source)
    _damage(kind, source)
    output, extra = tmp_path / "out.pth", []
    if kind == "not_a_folder":
        source = source / "COMPLETE"
    elif kind == "output_exists":
        output.write_text("keep me")
    elif kind == "ema_without_ema":
        assert convert(runs.w2, tmp_path / "m.pth", "--format", "pth") == 0
        assert convert("--to-dcp", tmp_path / "m.pth", tmp_path / "no_ema") == 0
        source, extra = tmp_path / "no_ema", ["--ema"]
    capsys.readouterr()
    assert convert(source, output, "--format", "pth", *extra) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    if kind == "output_exists":
        assert output.read_text() == "keep me"
    else:
        assert not output.exists()


@pytest.mark.slow
def test_overwrite_replaces_a_previous_output_but_not_an_unrelated_folder(runs, tmp_path, capsys):
    assert convert(runs.w1, tmp_path / "out.pth", "--format", "pth") == 0
    assert convert(runs.w2, tmp_path / "out.pth", "--format", "pth") == 2
    assert "out.pth already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert convert(runs.w2, tmp_path / "out.pth", "--format", "pth", "--overwrite") == 0
    assert_same_state(torch.load(tmp_path / "out.pth", weights_only=True)["state_dict"], runs.full["model"])
    (tmp_path / "notes.pth").write_text("mine")
    assert convert(runs.w2, tmp_path / "notes.pth", "--format", "pth", "--overwrite") == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "notes.pth").read_text() == "mine"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    assert convert(runs.w2, tmp_path / "notes", "--format", "safetensors", "--overwrite") == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


@pytest.mark.slow
def test_an_interrupted_conversion_leaves_nothing_behind(runs, tmp_path, monkeypatch, capsys):
    writes = []
    original_write = torch_file._write_at

    def full_disk_on_third(file, data, offset):
        writes.append(offset)
        if len(writes) == 3:
            raise OSError(28, "No space left on device", file.name)
        original_write(file, data, offset)

    monkeypatch.setattr(torch_file, "_write_at", full_disk_on_third)
    assert convert(runs.w2, tmp_path / "out") == 2
    assert f"no space left on {tmp_path / 'out'}: needs about" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output, no temporaries, not even the output folder


@pytest.mark.slow
def test_a_conversion_failing_at_its_last_publish_leaves_nothing_behind(runs, tmp_path, monkeypatch, capsys):
    real_publish = staging.publish

    def second_publish_fails(temp, final, replace=False):
        if final.suffix == ".pth":  # the accelerate folder is published first, then the .pth beside it
            raise OSError(28, "No space left on device", str(final))
        real_publish(temp, final, replace)

    monkeypatch.setattr(staging, "publish", second_publish_fails)
    assert convert(runs.w2, tmp_path / "new" / "out") == 2
    assert f"no space left on {tmp_path / 'new' / 'out'}: needs about" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither output, no temporaries, not the folders made for them


@pytest.mark.slow
def test_a_full_disk_is_an_oserror_and_does_not_abort_the_process(tmp_path):
    """A write on a full disk must raise (and the conversion report it), not kill the process."""
    script = (
        "import torch\n"
        "from sana2.formats.torch_file import save_torch_file\n"
        "try:\n"
        "    save_torch_file('/dev/full', {'w': torch.zeros(1000, 1000)})\n"
        "except OSError as exc:\n"
        "    print('OSError', exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OSError") and "/dev/full" in result.stdout, result.stdout


# -- verify -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_verify_catches_a_corrupted_output_file(runs, tmp_path):
    path = tmp_path / "m.pth"
    assert convert(runs.w2, path, "--format", "pth") == 0
    _flip_a_byte_in_the_data_of(path, runs.full["model"]["blocks.1.attn.qkv.weight"])  # one bit in one tensor
    with pytest.raises(VerificationFailed, match="blocks.1.attn.qkv.weight: differs"):
        verify_pth(plan_export(DcpCheckpoint(runs.w2), False, None, True), path)


@pytest.mark.slow
def test_verify_flag_fails_the_conversion_and_commits_nothing_when_a_tensor_is_wrong(
    runs, tmp_path, monkeypatch, capsys
):
    original_save = export.save_torch_file

    def perturb_one(path, obj):
        weights = obj["state_dict"]
        name = list(weights)[5]
        source = weights[name]

        def wrong_fill(out, start):
            source.fill(out, start)
            out.view(-1)[0] += 1

        weights[name] = dataclasses.replace(source, fill=wrong_fill)
        original_save(path, obj)

    monkeypatch.setattr(export, "save_torch_file", perturb_one)
    assert convert(runs.w2, tmp_path / "m.pth", "--format", "pth", "--verify") == 2
    err = capsys.readouterr().err
    assert "verify FAILED: 1 differences" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


# -- pieces -----------------------------------------------------------------------------------
def test_streamed_torch_save_reads_back_like_torch_save(tmp_path):
    tensors = {
        "w": torch.randn(3, 4),
        "bf": torch.randn(5).bfloat16(),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(7.0),
        "ints": torch.arange(6).view(2, 3),
    }
    structure = {
        "state": {name: SourceTensor.of(name, t) for name, t in tensors.items()},
        "in_memory": torch.ones(2, 2),
        "plain": [1, (2.5, "x"), None],
    }
    torch_file.save_torch_file(tmp_path / "s.pt", structure)
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "s.pt", weights_only=True, mmap=mmap)
        assert loaded["plain"] == [1, (2.5, "x"), None]
        assert_same_state(loaded["state"], tensors)
        assert_same_bits(loaded["in_memory"], torch.ones(2, 2))
    strided = {"t": torch.randn(4, 3).t(), "view": torch.arange(10.0)[3:7]}
    torch.save(strided, tmp_path / "ref.pt")
    read_back = torch_file.read_torch_file(tmp_path / "ref.pt")
    for name, tensor in strided.items():
        assert_same_bits(read_back[name].read(), tensor.contiguous(), name)
        assert_same_bits(read_back[name].read(1, 3), tensor[1:3].contiguous(), name)


def test_progress_draws_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    shown, hidden = Terminal(), io.StringIO()
    for stream in (shown, hidden):
        tensors = [SourceTensor.of(name, torch.zeros(250)) for name in ("a", "b")]
        with progress_bar("pth", tensors, file=stream) as bar:
            for tensor in tracked(tensors, bar):
                tensor.read()
    # 2 x 250 float32 = 2000 bytes, counted as they are read
    assert "pth" in shown.getvalue() and "100%" in shown.getvalue() and "1.95k/1.95k" in shown.getvalue()
    assert hidden.getvalue() == ""


@pytest.mark.slow
def test_command_line_wrapper_and_module_run_from_the_repo_root(runs, tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", str(runs.w2), str(tmp_path / "m.pth"), "--format", "pth"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and (tmp_path / "m.pth").is_file()
    assert convert_checkpoint.parse_size("5GB") == 5 * 10**9 and convert_checkpoint.parse_size("2GiB") == 2 * 2**30


@pytest.fixture(scope="module")
def step_folder_run(tmp_path_factory) -> Path:
    """A step folder of the tiny digits model, saved by one process as the trainer does."""
    root = tmp_path_factory.mktemp("one_process")
    save_single_process_run(root / "step-1", load_config(None, TINY), steps=1)
    return root / "step-1"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "output, flags, message",
    [
        ("step-1/config.toml", ["--format", "pth"], "step-1/config.toml: it lies inside the input"),
        ("step-1/.metadata", ["--format", "pth"], "step-1/.metadata: it lies inside the input"),
        ("step-1", ["--format", "safetensors"], "step-1: it is one of this command's inputs"),
        ("step-1/export", ["--format", "accelerate"], "it lies inside the input"),
        (".", ["--format", "diffusers"], ": it contains the input"),
    ],
)
def test_overwrite_never_replaces_the_source_or_anything_inside_it(
    step_folder_run, tmp_path, capsys, output, flags, message
):
    source = tmp_path / "step-1"
    shutil.copytree(step_folder_run, source)
    before = _tree(tmp_path)
    assert convert(source, tmp_path / output, *flags, "--overwrite") == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert _tree(tmp_path) == before


def test_to_dcp_overwrite_replaces_its_own_import_but_not_a_training_checkpoint(step_folder_run, tmp_path, capsys):
    model = tmp_path / "model.pth"
    assert convert(step_folder_run, model, "--format", "pth") == 0
    assert convert("--to-dcp", model, tmp_path) == 2  # the folder holding the input
    assert "it contains the input" in capsys.readouterr().err
    assert convert("--to-dcp", model, tmp_path / "imported") == 0
    assert convert("--to-dcp", model, tmp_path / "imported", "--overwrite") == 0
    training = tmp_path / "step-1"
    shutil.copytree(step_folder_run, training)
    before = _tree(training)
    assert convert("--to-dcp", model, training, "--overwrite") == 2
    assert "refusing to replace" in capsys.readouterr().err
    assert _tree(training) == before


@pytest.mark.parametrize("error", ["ENOSPC", "unexpected pos"])
def test_a_disk_filling_during_to_dcp_is_named_with_the_bytes_and_leaves_nothing(
    step_folder_run, tmp_path, monkeypatch, capsys, error
):
    from full_disk import fill_disk_in_dcp_data_files, torch_save_short_write_error

    from sana2.formats.dcp_folder import ChecksummingWriter

    model = tmp_path / "model.pth"
    assert convert(step_folder_run, model, "--format", "pth") == 0
    capsys.readouterr()

    def short_write(self, plan, planner):
        raise torch_save_short_write_error()

    if error == "ENOSPC":
        fill_disk_in_dcp_data_files(monkeypatch)
    else:
        monkeypatch.setattr(ChecksummingWriter, "write_data", short_write)
    assert convert("--to-dcp", model, tmp_path / "imported") == 2
    err = capsys.readouterr().err
    assert f"error: no space left on {tmp_path / 'imported'}: needs about " in err and " free" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and "unexpected pos" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]


@pytest.mark.parametrize("form", ["accelerate", "pth", "safetensors", "diffusers"])
def test_a_lora_step_folder_is_refused_naming_its_base_and_nothing_is_written(tmp_path, capsys, form):
    """A LoRA run checkpoints its adapters, not its frozen base: an export of them alone is a model without
    most of its weights, so every format refuses it and names the base the adapters belong to."""
    folder, base = _lora_like_step_folder(tmp_path)
    output = tmp_path / ("out" if form in ("accelerate", "diffusers") else f"out.{form}")
    capsys.readouterr()
    assert convert(folder, output, "--format", form) == 2
    err = capsys.readouterr().err
    assert "LoRA run's checkpoint" in err and str(base) in err and "--merge-lora" in err, err
    assert "--format diffusers-lora" in err, err
    assert err.count("\n") == 1, err
    assert not output.exists()


def _lora_like_step_folder(tmp_path, adapters=True):
    """A step folder as a LoRA run saves one (its adapters, the null caption, its base named), or without adapters."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "step-2"
    model = {"y_embedder.y_embedding": torch.zeros(3, 8)}
    if adapters:
        model["blocks.0.attn.qkv.lora_A.default.weight"] = torch.zeros(4, 8)
        model["blocks.0.attn.qkv.lora_B.default.weight"] = torch.zeros(24, 4)
    dcp.save({"model": model, "train_state": {"step": 2, "epoch": 0}}, checkpoint_id=folder, no_dist=True)
    (folder / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1}))
    base = tmp_path / "released.safetensors"
    (folder / "config.json").write_text(json.dumps({"checkpoint": {"initial_load_path": str(base)}}))
    return folder, base


@pytest.mark.parametrize(
    "adapters, flags, message",
    [
        (False, [], "holds no LoRA adapters (it is no LoRA run's); drop --format diffusers-lora"),
        (True, ["--merge-lora"], "--format diffusers-lora writes the adapters, --merge-lora the merged model"),
    ],
    ids=["no-adapters", "with-merge-lora"],
)
def test_diffusers_lora_needs_a_lora_folder_and_no_merge(tmp_path, capsys, adapters, flags, message):
    folder, _ = _lora_like_step_folder(tmp_path, adapters)
    capsys.readouterr()
    assert convert(folder, tmp_path / "lora", "--format", "diffusers-lora", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "lora").exists()
