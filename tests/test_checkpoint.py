"""DCP checkpoints: exact resume, resharding across world sizes, atomic saves under SIGKILL and full
disks, SIGTERM and SIGINT, async saves, retention, and one clear message per broken checkpoint."""

import copy
import errno
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from checkpoint_factory import step_folder
from dist_utils import free_port, run_command, run_distributed, torchrun_command
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from train_utils import TINY, full_model_state, run_steps, tiny_config

from sana2.components.checkpoint import COMPLETE_MARKER, CheckpointError, CheckpointManager, complete_checkpoints

TESTS = Path(__file__).parent
# cosine schedule with warmup, EMA and gradient accumulation: every piece of state resume must restore
RUN = [
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",
    "--training.global_batch_size=16",
    "--training.gradient_accumulation_steps=2",
    "--training.steps=6",
    "--training.ema_decay=0.9",
    "--lr_scheduler.warmup_steps=2",
    "--lr_scheduler.decay_type=cosine",
]
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A parent for the tests' dump folders, so they share one digits cache (built beside them)."""
    return tmp_path_factory.mktemp("runs")


def training_snapshot(trainer) -> dict:
    """Everything a resume must restore, unsharded (collective: every rank must call it).

    Copied: on one process the "full" tensors are the parameters themselves, which training changes.
    """
    return copy.deepcopy(
        {
            "step": trainer.step,
            "model": full_model_state(trainer.model),
            "optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer, options=FULL),
            "ema": {name: shard.full_tensor() for name, shard in trainer.ema.shadow.items()},
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "dataloader": trainer.loader.state_dict(),
        }
    )


def assert_same(actual, expected, where: str = "") -> None:
    """Bit-identical nested state: tensors by value and dtype, everything else by equality."""
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} vs {type(expected).__name__}"
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {set(actual) ^ set(expected)} differ"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} vs {len(expected)}"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where}: tensors differ"
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(actual, expected), f"{where}: arrays differ"
    else:
        assert actual == expected, f"{where}: {actual!r} vs {expected!r}"


def checkpoint_contents(folder: Path, tmp: Path) -> dict:
    """Every entry of a DCP checkpoint as full tensors and objects, read without a process group."""
    out = tmp / f"{folder.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


# -- exact resume at the same world size ---------------------------------------------------------


def _stop_and_resume(rank, world_size, runs, out_file):
    from sana2.components.train_state import capture_rng
    from sana2.train import Trainer

    straight = Trainer(tiny_config(runs / "straight", *RUN))
    straight_losses = run_steps(straight, 6)
    straight_end = training_snapshot(straight)

    stopped = Trainer(tiny_config(runs / "stopped", *RUN))
    losses = run_steps(stopped, 3)
    torch.rand(3), random.random(), np.random.rand()  # move every global RNG: resume must restore them
    rng_at_stop = capture_rng()
    stopped.save_checkpoint(final=True)
    del stopped

    resumed = Trainer(tiny_config(runs / "stopped", *RUN))
    assert resumed.step == 3
    assert_same(capture_rng(), rng_at_stop, f"rank {rank} rng")
    losses += run_steps(resumed, 3)
    resumed_end = training_snapshot(resumed)
    if rank == 0:
        torch.save({"straight": (straight_losses, straight_end), "resumed": (losses, resumed_end)}, out_file)


@pytest.mark.slow
def test_stopped_and_resumed_run_is_bit_identical_to_an_uninterrupted_one(runs, tmp_path):
    run_distributed(_stop_and_resume, 2, runs / "exact", tmp_path / "result.pt")
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    straight_losses, straight_end = result["straight"]
    resumed_losses, resumed_end = result["resumed"]
    assert resumed_losses == straight_losses  # exact floats: same data order, noise and updates
    assert_same(resumed_end, straight_end, "state after 6 steps")


# -- resume at another world size ----------------------------------------------------------------


def _train_and_save_at_step_2(rank, world_size, dump, out_file):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *RUN))
    run_steps(trainer, 2)
    trainer.save_checkpoint(final=True)
    snapshot = training_snapshot(trainer)
    next_loss = run_steps(trainer, 1)[0]
    if rank == 0:
        torch.save({"snapshot": snapshot, "next_loss": next_loss}, out_file)


def _resume_record_and_save(rank, world_size, source, dump, out_file):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *RUN, f"--checkpoint.resume_from={source}"))
    snapshot = training_snapshot(trainer)
    trainer.save_checkpoint(final=True)  # the same state, now written by this world size
    next_loss = run_steps(trainer, 1)[0]
    if rank == 0:
        torch.save({"snapshot": snapshot, "next_loss": next_loss}, out_file)


@pytest.mark.slow
def test_resume_across_world_sizes_restores_identical_model_and_optimizer_state(runs, tmp_path):
    run_distributed(_train_and_save_at_step_2, 4, runs / "w4", tmp_path / "w4.pt")
    chain = [(2, runs / "w4", "w4to2"), (1, runs / "w4to2", "w2to1"), (4, runs / "w4to2", "w2to4")]
    for world_size, source, name in chain:
        run_distributed(
            _resume_record_and_save, world_size, str(step_folder(source, 2)), runs / name, tmp_path / f"{name}.pt"
        )
    saved = torch.load(tmp_path / "w4.pt", weights_only=False)
    for _, _, name in chain:
        resumed = torch.load(tmp_path / f"{name}.pt", weights_only=False)
        assert_same(resumed["snapshot"], saved["snapshot"], name)
        # the next step sees the same global batch; only the reduction order differs across world sizes
        assert abs(resumed["next_loss"] - saved["next_loss"]) < 1e-5, name


# -- async saves ---------------------------------------------------------------------------------


def _save_one_state_sync_and_async(rank, world_size, runs, blocking_file):
    from sana2.components import checkpoint
    from sana2.train import Trainer

    training_went_on = threading.Event()
    write_shard = checkpoint.ChecksummingWriter.write_data

    def write_after_training_went_on(self, plan, planner):
        if Path(self.path).parent.name == "async":
            assert training_went_on.wait(timeout=120)
        return write_shard(self, plan, planner)

    checkpoint.ChecksummingWriter.write_data = write_after_training_went_on
    trainer = Trainer(tiny_config(runs / "train", *RUN))
    run_steps(trainer, 2)
    files = {"config.json": trainer.config.to_json()}
    CheckpointManager(runs / "sync", 1, 0, "disabled", rank).save(2, trainer.states, files)
    async_manager = CheckpointManager(runs / "async", 1, 0, "async", rank)
    blocked = async_manager.save(2, trainer.states, files)
    run_steps(trainer, 2)  # training goes on, changing every parameter in place, before the save is written
    training_went_on.set()
    async_manager.wait()
    if rank == 0:
        Path(blocking_file).write_text(str(blocked))


@pytest.mark.slow
def test_async_save_writes_the_same_tensors_as_a_sync_save_of_that_moment(runs, tmp_path):
    dumps = runs / "async"
    run_distributed(_save_one_state_sync_and_async, 2, dumps, tmp_path / "blocked.txt")
    sync_folder, async_folder = dumps / "sync" / "step-2", dumps / "async" / "step-2"
    assert (async_folder / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in async_folder.iterdir()) == sorted(p.name for p in sync_folder.iterdir())
    assert_same(checkpoint_contents(async_folder, tmp_path), checkpoint_contents(sync_folder, tmp_path))
    assert float((tmp_path / "blocked.txt").read_text()) >= 0


# -- a full disk ---------------------------------------------------------------------------------


def _collect_errors() -> list[str]:
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger("sana2").addHandler(handler)
    return errors


def _disk_full_at_step_4(rank, world_size, runs, out_file):
    """Three saves that fail at step 4: rank 1's shard, then the final save, then rank 0's publishing."""
    from sana2 import staging
    from sana2.components import checkpoint
    from sana2.train import Trainer

    errors = _collect_errors()
    failing = {"folder": "step-4.partial"}
    write_shard = checkpoint.ChecksummingWriter.write_data

    def write_until_disk_full(self, plan, planner):
        if rank == 1 and Path(self.path).name == failing["folder"]:
            shard = Path(self.path) / "__1_0.distcp"
            shard.write_bytes(b"\0" * 1000)  # half a shard, as a full disk leaves it
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))
        return write_shard(self, plan, planner)

    real_fsync = staging.fsync_path

    def fsync_on_full_disk(path):
        if failing["folder"] == "publish" and Path(path).parent.name == "step-4.partial":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_fsync(path)

    checkpoint.ChecksummingWriter.write_data = write_until_disk_full
    staging.fsync_path = fsync_on_full_disk  # what checkpoint publishing flushes with
    overrides = ("--checkpoint.interval=2", "--checkpoint.keep_latest_k=2", "--training.ema_decay=0")
    outcome = {}

    periodic = Trainer(tiny_config(runs / "periodic", *RUN, *overrides))
    periodic.train()
    outcome["periodic"] = {"step": periodic.step, "errors": list(errors)}

    errors.clear()
    final = Trainer(tiny_config(runs / "final", *RUN, *overrides, "--training.steps=4"))
    try:
        final.train()
        outcome["final"] = {"raised": None}
    except CheckpointError as exc:
        outcome["final"] = {"raised": str(exc), "step": final.step}

    errors.clear()
    failing["folder"] = "publish"  # now rank 0 alone fails, while making the written checkpoint visible
    publish = Trainer(tiny_config(runs / "publish", *RUN, *overrides))
    publish.train()
    outcome["publish"] = {"step": publish.step, "errors": list(errors)}
    if rank == 0:
        torch.save(outcome, out_file)


@pytest.mark.slow
def test_a_full_disk_loses_only_the_failed_save(runs, tmp_path):
    dumps = runs / "disk_full"
    run_distributed(_disk_full_at_step_4, 2, dumps, tmp_path / "outcome.pt")
    outcome = torch.load(tmp_path / "outcome.pt")

    for case in ("periodic", "publish"):  # logged, discarded, training goes on; nothing good is deleted
        checkpoints = dumps / case / "checkpoint"
        assert outcome[case]["step"] == 6
        assert [step for step, _ in complete_checkpoints(checkpoints)] == [2, 6]
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-6"]
        [error] = outcome[case]["errors"]
        assert f"{checkpoints / 'step-4.partial'} discarded" in error
        assert f"the latest complete checkpoint {checkpoints / 'step-2'} is intact" in error
        assert "No space left on device" in error and "training continues" in error
    assert "rank 1: OSError" in outcome["periodic"]["errors"][0]
    assert "rank 0: OSError" in outcome["publish"]["errors"][0]

    final = outcome["final"]  # the run's last state cannot be saved: stop with the reason
    assert final["raised"] and final["step"] == 4
    assert "checkpoint step 4 was not saved" in final["raised"] and "No space left on device" in final["raised"]
    assert sorted(p.name for p in (dumps / "final" / "checkpoint").iterdir()) == ["step-2"]


# -- the checkpoint manager on its own: retention, "latest", leftovers ---------------------------


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(value: float) -> dict:
    return {"weights": torch.full((4,), value), "train_state": {"step": int(value)}}


def _loaded_value(manager: CheckpointManager, path: Path) -> float:
    return manager.load(path, _state(0.0))["weights"][0].item()


def test_retention_keeps_the_latest_k(tmp_path, one_process_group):
    manager = CheckpointManager(tmp_path, 1, 2, "disabled", 0)
    for step in range(1, 5):
        manager.save(step, _state(step), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    keep_all = CheckpointManager(tmp_path / "all", 1, 0, "disabled", 0)
    for step in range(1, 4):
        keep_all.save(step, _state(step), {})
    assert [step for step, _ in complete_checkpoints(tmp_path / "all")] == [1, 2, 3]


def test_a_run_resumed_from_an_older_checkpoint_owns_latest_and_retention_keeps_its_save(tmp_path, one_process_group):
    first_run = CheckpointManager(tmp_path, 1, 1, "disabled", 0)
    for step in (2, 4, 6):
        first_run.save(step, _state(step), {})
    second_run = CheckpointManager(tmp_path, 1, 1, "disabled", 0)
    second_run.load(tmp_path / "step-6", _state(0.0))
    # pretend the user went back: a run resumed from an older state saves a lower step than step-6
    second_run.save(5, _state(50.0), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5"]  # keep_latest_k=1 kept the new save
    assert second_run.resume_path("latest") == tmp_path / "step-5"

    branch = CheckpointManager(tmp_path / "branch", 1, 3, "disabled", 0)
    for step in (2, 4):
        branch.save(step, _state(step), {})
    resumed = CheckpointManager(tmp_path / "branch", 1, 3, "disabled", 0)
    resumed.load(tmp_path / "branch" / "step-2", _state(0.0))
    resumed.save(3, _state(30.0), {})
    resumed.save(4, _state(40.0), {})  # replaces the abandoned step-4
    assert resumed.resume_path("latest") == tmp_path / "branch" / "step-4"
    assert _loaded_value(resumed, tmp_path / "branch" / "step-4") == 40.0
    assert sorted(p.name for p in (tmp_path / "branch").iterdir()) == ["step-2", "step-3", "step-4"]


def test_incomplete_folders_are_never_resumed_and_the_next_save_removes_leftovers(tmp_path, one_process_group):
    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    manager.save(2, _state(2.0), {})
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-9.partial")  # a save killed before its rename
    unmarked = tmp_path / "step-8"  # a copy without its COMPLETE marker
    shutil.copytree(tmp_path / "step-2", unmarked)
    (unmarked / COMPLETE_MARKER).unlink()
    assert manager.resume_path("latest") == tmp_path / "step-2"
    with pytest.raises(CheckpointError, match=f"{unmarked} is incomplete"):
        manager.load(unmarked, _state(0.0))
    manager.save(3, _state(3.0), {})
    assert not (tmp_path / "step-9.partial").exists()
    assert manager.resume_path("latest") == tmp_path / "step-3"


def test_saving_the_step_just_resumed_writes_nothing(tmp_path, one_process_group):
    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    manager.save(2, _state(2.0), {})
    marker = (tmp_path / "step-2" / COMPLETE_MARKER).read_text()
    resumed = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    resumed.load(tmp_path / "step-2", _state(0.0))
    resumed.save(2, _state(2.0), {}, final=True)
    assert (tmp_path / "step-2" / COMPLETE_MARKER).read_text() == marker


def test_a_save_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, one_process_group, monkeypatch):
    from sana2 import staging

    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: SimpleNamespace(free=10))
    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    manager.save(1, _state(1.0), {})  # periodic: logged, training would go on
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError) as error:
        manager.save(2, _state(2.0), {}, final=True)
    assert f"checkpoint step 2 was not saved ({tmp_path / 'step-2.partial'} discarded; no checkpoint exists yet)" in (
        str(error.value)
    )
    assert str(error.value).endswith(f"no space left on {tmp_path}: needs about 16 B, 10 B free")
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_during_a_save_is_named_even_when_the_writer_hides_it(
    tmp_path, one_process_group, monkeypatch
):
    from sana2 import staging
    from sana2.components import checkpoint

    disk = {"free": 10**9}
    monkeypatch.setattr(staging.shutil, "disk_usage", lambda path: SimpleNamespace(free=disk["free"]))
    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    manager.save(1, _state(1.0), {})

    def fill_the_disk(self, plan, planner):
        disk["free"] = 3
        # what torch.save's zip writer says on a full disk, without an errno
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.ChecksummingWriter, "write_data", fill_the_disk)
    with pytest.raises(CheckpointError) as error:
        manager.save(2, _state(2.0), {}, final=True)
    message = str(error.value)
    assert f"the latest complete checkpoint {tmp_path / 'step-1'} is intact" in message
    assert f"no space left on {tmp_path}: needs about 16 B, 3 B free (rank 0: RuntimeError:" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_short_write_of_a_full_disk_is_named_even_when_the_discarded_save_freed_enough(
    tmp_path, one_process_group, monkeypatch
):
    """torch.save inside DCP meets a full disk as a short write and says only "unexpected pos": still
    named a full disk, though deleting the discarded save left room again."""
    from full_disk import torch_save_short_write_error

    from sana2.components import checkpoint

    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    manager.save(1, _state(1.0), {})

    def fill_the_disk(self, plan, planner):
        raise torch_save_short_write_error()

    monkeypatch.setattr(checkpoint.ChecksummingWriter, "write_data", fill_the_disk)
    with pytest.raises(CheckpointError) as error:
        manager.save(2, _state(2.0), {}, final=True)
    message = str(error.value)
    assert f"the latest complete checkpoint {tmp_path / 'step-1'} is intact" in message
    assert f"no space left on {tmp_path}: needs about 16 B and the filesystem's overhead" in message
    assert "unexpected pos" in message  # what the writer said, kept in parentheses
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_save_missing_a_shard_its_metadata_names_is_never_published(tmp_path, one_process_group, monkeypatch):
    from sana2.components import checkpoint

    write_shard = checkpoint.ChecksummingWriter.write_data

    def lose_the_shard(self, plan, planner):  # e.g. another run removing what it took for leftovers
        written = write_shard(self, plan, planner)
        (Path(self.path) / "__0_0.distcp").unlink()
        return written

    monkeypatch.setattr(checkpoint.ChecksummingWriter, "write_data", lose_the_shard)
    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    with pytest.raises(CheckpointError, match=r"rank 0: checkpoint shard \S+/step-3.partial/__0_0.distcp is missing"):
        manager.save(3, _state(3.0), {}, final=True)
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_newest_checkpoint_names_the_newest_intact_earlier_one_and_the_flag(tmp_path, one_process_group):
    from sana2.formats.tensors import DamagedCheckpointError

    manager = CheckpointManager(tmp_path, 1, 0, "disabled", 0)
    for step in (2, 4, 6):
        manager.save(step, _state(step), {})
    os.truncate(tmp_path / "step-6" / "__0_0.distcp", 3)
    (tmp_path / "step-4" / "__0_0.distcp").unlink()
    resumed = CheckpointManager(tmp_path, 1, 0, "disabled", 0, states=_state(0.0))
    with pytest.raises(DamagedCheckpointError) as error:
        resumed.resume("latest")
    assert f"checkpoint shard {tmp_path / 'step-6' / '__0_0.distcp'} is truncated" in str(error.value)
    assert str(error.value).endswith(
        f"the newest earlier checkpoint with all its files is {tmp_path / 'step-2'}: resume from it with "
        f"--checkpoint.resume_from=step-2"
    )
    assert resumed.resume(tmp_path / "step-2") == tmp_path / "step-2"
    (tmp_path / "step-2" / "__0_0.distcp.crc32.json").unlink()
    with pytest.raises(DamagedCheckpointError, match=f"{tmp_path} holds no earlier checkpoint with all its files: "):
        resumed.resume(tmp_path / "step-6")


# -- broken checkpoints: one message naming the file and the key --------------------------------


def _save_at_step_2(rank, world_size, dump):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *RUN))
    run_steps(trainer, 2)
    trainer.save_checkpoint(final=True)


@pytest.fixture(scope="module")
def saved_checkpoint(runs) -> Path:
    """step-2 of a 2-rank run with EMA, saved once for all the error tests."""
    run_distributed(_save_at_step_2, 2, runs / "intact")
    return step_folder(runs / "intact", 2)


def _flip_bytes_in_the_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    file.write_bytes(bytes(data))


def _truncate_to_half(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


# each damage takes a copy of the intact step-2 folder and returns the path to resume from
def _intact(folder: Path) -> Path:
    return folder


def _missing(folder: Path) -> Path:
    return folder.parent / "nowhere" / "step-2"


def _without_marker(folder: Path) -> Path:
    (folder / COMPLETE_MARKER).unlink()
    return folder


def _truncated_shard(folder: Path) -> Path:
    _truncate_to_half(folder / "__1_0.distcp")
    return folder


def _corrupt_shard(folder: Path) -> Path:
    _flip_bytes_in_the_middle(folder / "__0_0.distcp")
    return folder


def _corrupt_metadata(folder: Path) -> Path:
    _truncate_to_half(folder / ".metadata")
    return folder


BROKEN = [
    ("missing folder", _missing, [], r"checkpoint folder \S+/nowhere/step-2 does not exist"),
    ("no COMPLETE marker", _without_marker, [], r"\S+/step-2 is incomplete"),
    (
        "truncated shard",
        _truncated_shard,
        [],
        r"checkpoint shard \S+/step-2/__1_0\.distcp is truncated: it has \d+ bytes, but \S+ is stored at bytes",
    ),
    (
        "corrupt shard",
        _corrupt_shard,
        [],
        r"checkpoint shard \S+/step-2/__0_0\.distcp is corrupt: the bytes of (model|optimizer|ema)\.\S+ \(offset",
    ),
    ("corrupt metadata", _corrupt_metadata, [], r"\S+/step-2/\.metadata is corrupt"),
    (
        "wider model",
        _intact,
        ["--model.hidden_size=96"],
        r"checkpoint \S+/step-2 does not match this run .*model\.\S+ has shape \(\d+, 64\), this run needs \(\d+, 96\)",
    ),
    ("deeper model", _intact, ["--model.depth=3"], r"does not match this run .*model\.blocks\.2\.\S+ is missing"),
    (
        "shallower model",
        _intact,
        ["--model.depth=1"],
        r"does not match this run .*model\.blocks\.1\.\S+ is stored but this model has no such tensor",
    ),
    (
        "other global batch",
        _intact,
        ["--training.global_batch_size=32"],
        r"checkpoint \S+/step-2: data loader state was saved with global batch size 16, but this run uses 32",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("damage, overrides, message", [case[1:] for case in BROKEN], ids=[c[0] for c in BROKEN])
@pytest.mark.slow
def test_a_broken_checkpoint_stops_with_one_message_naming_file_and_key(
    saved_checkpoint, tmp_path, damage, overrides, message, capfd
):
    from sana2.train import main

    folder = tmp_path / "copy" / "step-2"
    shutil.copytree(saved_checkpoint, folder)
    resume_from = damage(folder)
    dump = saved_checkpoint.parents[2] / f"broken-{tmp_path.name}"  # beside the others: shares their digits cache
    argv = [*TINY, f"--job.dump_folder={dump}", *RUN, *overrides, f"--checkpoint.resume_from={resume_from}"]
    assert main(argv) == 2
    error_lines = [line for line in capfd.readouterr().err.splitlines() if " ERROR " in line]
    assert len(error_lines) == 1 and "Traceback" not in error_lines[0]
    assert re.search(message, error_lines[0]), error_lines[0]


# -- whole jobs under torchrun: SIGKILL during a save, SIGTERM or SIGINT during training -----------


def _torchrun(script: list[str], dump: Path, *overrides: str) -> list[str]:
    checkpointed = ["--checkpoint.enable=true", "--training.global_batch_size=16", "--metrics.log_freq=1"]
    return torchrun_command(2, *script, *TINY, f"--job.dump_folder={dump}", *checkpointed, *overrides)


def _run(command: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return run_command(command, env, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1], ids=["coordinator rank 0", "rank 1"])
@pytest.mark.slow
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_to_resume(runs, victim):
    dump = runs / f"killed-rank{victim}"
    run = ("--training.steps=6", "--checkpoint.interval=2")
    killed = _run(
        _torchrun([str(TESTS / "save_killer.py")], dump, *run), env={"KILL_RANK": str(victim), "KILL_STEP": "4"}
    )
    checkpoints = dump / "checkpoint"
    assert killed.returncode != 0
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [2]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4.partial"]
    assert not (checkpoints / "step-4.partial" / COMPLETE_MARKER).exists()

    resumed = _run(_torchrun(["-m", "sana2.train"], dump, *run))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step-2'} at step 2" in resumed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4", "step-6"]


def _worker_pids(parent: int) -> list[int]:
    """The processes whose parent is `parent` (torchrun's workers)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(entry.name))
    return children


def _wait_for_line(process: subprocess.Popen, pattern: str, seen: list[str], timeout: float) -> None:
    """Collect the process's output lines into `seen` (in a thread) until one matches `pattern`."""
    done = threading.Event()

    def read():
        for line in process.stdout:
            seen.append(line)
            if re.search(pattern, line):
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), f"no {pattern!r} within {timeout}s:\n{''.join(seen)[-3000:]}"


@pytest.mark.slow
def test_a_stop_signal_to_the_workers_saves_exits_0_and_resume_continues_from_that_step(runs):
    """As Slurm's scancel signals every process of a job (tests/test_launch.py signals the launcher): SIGTERM to
    one worker, SIGINT (Ctrl-C) to the other, so one run shows that each rank stops cleanly on either signal (a
    rank without a handler for its signal would die of it or raise KeyboardInterrupt, and the run exit non-zero)."""
    dump = runs / "signalled"
    command = _torchrun(["-m", "sana2.train"], dump, "--training.steps=100000", "--checkpoint.interval=100000")
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    seen: list[str] = []
    try:
        _wait_for_line(process, r"step +3/100000", seen, timeout=120)
        workers = sorted(_worker_pids(process.pid))
        assert len(workers) == 2, workers
        for pid, stop_signal in zip(workers, (signal.SIGTERM, signal.SIGINT)):
            os.kill(pid, stop_signal)
        assert process.wait(timeout=120) == 0, "".join(seen)[-3000:]
    finally:
        if process.poll() is None:  # a failed test must not leave its workers training
            for pid in _worker_pids(process.pid):
                os.kill(pid, signal.SIGKILL)
            process.kill()
    time.sleep(0.2)  # let the reader thread take the last lines
    output = "".join(seen)
    stopped_at = int(re.search(r"preempted at step (\d+), checkpoint step-\1 saved", output).group(1))
    checkpoints = dump / "checkpoint"
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [stopped_at]

    resumed = _run(_torchrun(["-m", "sana2.train"], dump, f"--training.steps={stopped_at + 1}"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / f'step-{stopped_at}'} at step {stopped_at}" in resumed.stderr
    assert f"step {stopped_at + 1}/{stopped_at + 1}" in resumed.stderr
    assert (checkpoints / f"step-{stopped_at + 1}" / COMPLETE_MARKER).is_file()
