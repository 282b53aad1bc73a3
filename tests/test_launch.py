"""Whole runs through the sana2 launcher, 2 worker processes, the debug model: preemption by SIGTERM
or Ctrl-C to the launcher, one owner per dump folder, one message and exit code 2 per user error.

Every test also checks that no complete-looking checkpoint it left lacks data."""

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from train_utils import TINY

from sana2.components.checkpoint import COMPLETE_MARKER, complete_checkpoints
from sana2.components.ownership import OWNER_FILE
from sana2.formats.dcp_folder import read_checked_metadata

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent
TRAIN = ["-m", "sana2.train"]
FAULTY = [str(TESTS / "faulty_train.py")]
BASE = [
    *TINY,
    "--checkpoint.enable=true",
    "--checkpoint.interval=100000",
    "--training.global_batch_size=16",
    "--metrics.log_freq=1",
]
# steps of 200 micro-batches (~5 s on CI, more under load): one cannot finish, and be saved, within a 6 s grace
# period whatever the machine's speed
SLOW_STEPS = ["--training.global_batch_size=800", "--training.gradient_accumulation_steps=200"]
# steps of 50 micro-batches (~2 s): a signal lands inside one
LONG_STEPS = ["--training.global_batch_size=200", "--training.gradient_accumulation_steps=50"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A parent for the tests' dump folders, so they share one digits cache (built beside them)."""
    return tmp_path_factory.mktemp("launch")


def launcher(dump: Path, *overrides: str, script=TRAIN, nodes=("--standalone", "--nnodes", "1"), nproc=2, config=()):
    """The launcher's command as run_train.sh builds it (rank 0's output shown, the others' in files)."""
    return [
        sys.executable,
        "-m",
        "sana2.launch",
        *nodes,
        "--nproc_per_node",
        str(nproc),
        "--local-ranks-filter",
        "0",
        "--tee",
        "3",
        *script,
        *config,
        *BASE,
        f"--job.dump_folder={dump}",
        *overrides,
    ]


def run(command: list[str], fault: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SANA2_FAULT": fault}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def run_in_process(command: list[str], capfd) -> subprocess.CompletedProcess:
    """A launcher() command whose launch the config check refuses, run as the launcher's main() in this process:
    the same exit code and console, without starting a Python and importing torch for it."""
    from sana2.launch import main

    assert command[:3] == [sys.executable, "-m", "sana2.launch"]
    quieted = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    ]
    levels = [logger.level for logger in quieted]  # main() quiets torchelastic: not for the tests after this one
    capfd.readouterr()
    try:
        code = main(command[3:])
    finally:
        for logger, level in zip(quieted, levels):
            logger.setLevel(level)
    console = capfd.readouterr()
    return subprocess.CompletedProcess(command, code, console.out, console.err)


class Running:
    """A launcher started in the background, its console collected line by line."""

    def __init__(self, command: list[str], fault: str = "", env: dict | None = None):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SANA2_FAULT": fault, **(env or {})}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output)
            if found or not self._reader.is_alive():
                break
            time.sleep(0.1)
        assert found, f"no {pattern!r} within {timeout} s:\n{self.output[-4000:]}"
        return found

    def finish(self, timeout: float = 180) -> int:
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def kill_everything(self) -> None:
        """SIGKILL the launcher and its workers (each worker leads its own process group)."""
        for pid in _children(self.process.pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.kill()
        self.process.wait()


def _children(parent: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.fixture
def background():
    """Launchers a test starts; any still running at its end is killed with its workers."""
    started: list[Running] = []
    yield lambda *args, **kwargs: started.append(Running(*args, **kwargs)) or started[-1]
    for running in started:
        if running.process.poll() is None:
            running.kill_everything()


def assert_no_checkpoint_lacks_data(dump: Path) -> None:
    """Every step-N folder with a COMPLETE marker holds every shard its .metadata names, whole."""
    folder = dump / "checkpoint"
    for path in folder.iterdir() if folder.is_dir() else []:
        if (path / COMPLETE_MARKER).exists():
            read_checked_metadata(path)


def checkpoint_contents(folder: Path, tmp: Path) -> dict:
    out = tmp / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=False)


def assert_same(actual, expected, where: str = "") -> None:
    assert type(actual) is type(expected), where
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and np.array_equal(actual, expected), where
    else:
        assert actual == expected, where


# -- preemption: SIGTERM or SIGINT to the launcher ------------------------------------------------


@pytest.mark.slow
def test_sigterm_to_the_launcher_mid_step_drops_the_step_saves_the_last_one_exits_0_and_resumes_exactly(
    runs, tmp_path, background
):
    dump, reference = runs / "preempted", runs / "uninterrupted"
    # the debug config, as run_train.sh runs it; before any save, half the grace period is kept for the save
    debug = [str(REPO / "train_configs" / "debug_model.toml")]
    run_args = [*BASE, *SLOW_STEPS, "--job.stop_grace_period=6"]
    preempted = background(
        ["./run_train.sh", *run_args, f"--job.dump_folder={dump}", "--training.steps=3"], env={"NGPU": "2"}
    )
    preempted.wait_for(r"step +1/3 ")
    # into step 2, which needs about as long as step 1 (5 s on CI): far more than the 2.4 s it may take
    # (6 s less the exit margin and the 3 s kept for the first save)
    time.sleep(0.5)
    preempted.process.send_signal(signal.SIGTERM)
    assert preempted.finish() == 0, preempted.output[-4000:]
    output = preempted.output
    assert "SIGTERM: the workers stop at their next safe point" in output
    assert re.search(r"step 2 cannot finish and be saved within the 6 s grace period .*: dropping it", output), output[
        -4000:
    ]
    assert "preempted at step 1, checkpoint step-1 saved" in output
    assert "Traceback" not in output and "SignalException" not in output
    checkpoints = dump / "checkpoint"
    assert [step for step, _ in complete_checkpoints(checkpoints)] == [1]
    assert not (dump / OWNER_FILE).exists()  # released
    assert_no_checkpoint_lacks_data(dump)

    # the resumed run ends where an uninterrupted one does, bit for bit
    resumed = run(launcher(dump, *run_args, "--training.steps=2", config=debug))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step-1'} at step 1" in resumed.stderr
    straight = run(launcher(reference, *run_args, "--training.steps=2", config=debug))
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same(
        checkpoint_contents(checkpoints / "step-2", tmp_path),
        checkpoint_contents(reference / "checkpoint" / "step-2", tmp_path),
    )


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_between_short_steps_finishes_the_step_saves_and_exits_0(runs, stop_signal, background):
    dump = runs / f"stopped-{stop_signal.name}"
    running = background(launcher(dump, "--training.steps=100000"))
    running.wait_for(r"step +3/100000")
    running.process.send_signal(stop_signal)
    assert running.finish() == 0, running.output[-4000:]
    stopped_at = int(running.wait_for(r"preempted at step (\d+), checkpoint step-\1 saved").group(1))
    assert stopped_at >= 3 and "Traceback" not in running.output
    assert [step for step, _ in complete_checkpoints(dump / "checkpoint")] == [stopped_at]
    assert_no_checkpoint_lacks_data(dump)


@pytest.mark.slow
def test_a_save_that_cannot_land_within_the_grace_period_is_announced_before_the_kill(runs, background):
    dump = runs / "slow-save"
    overrides = [*LONG_STEPS, "--training.steps=100000", "--job.stop_grace_period=6", "--checkpoint.interval=2"]
    running = background(launcher(dump, *overrides, script=FAULTY), fault="slow_save", env={"SANA2_SAVE_SECONDS": "8"})
    running.wait_for(r"step +3/100000")
    running.process.send_signal(signal.SIGTERM)  # during step 4: step 3 must be saved, which takes 8 s
    assert running.finish() == 128 + signal.SIGTERM
    output = running.output
    assert re.search(r"checkpoint step-3 may not land within the grace period: saving took up to [\d.]+ s", output)
    assert re.search(
        r"checkpoint step-3 is still being written: the kill will interrupt it; checkpoint \S+/step-2", output
    )
    assert "the 6 s grace period is over and 2 worker(s) still run: killing them" in output
    assert output.index("is still being written") < output.index("grace period is over")
    assert [step for step, _ in complete_checkpoints(dump / "checkpoint")] == [2]
    assert_no_checkpoint_lacks_data(dump)


@pytest.mark.slow
def test_a_signal_to_one_nodes_launcher_stops_a_two_node_job_which_holds_its_folder_once(runs, background):
    from dist_utils import free_port

    dump = runs / "two-nodes"
    nodes = [
        "--nnodes",
        "2",
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"localhost:{free_port()}",
        "--rdzv_id",
        "job7",
    ]
    first, second = (background(launcher(dump, "--training.steps=100000", nodes=nodes, nproc=1)) for _ in "ab")
    deadline = time.monotonic() + 240
    while not re.search(r"step +3/100000", first.output + second.output) and time.monotonic() < deadline:
        time.sleep(0.2)
    second.process.send_signal(signal.SIGTERM)
    assert first.finish() == 0 and second.finish() == 0, (first.output + second.output)[-4000:]
    both = first.output + second.output
    stopped_at = int(re.search(r"preempted at step (\d+), checkpoint step-\1 saved", both).group(1))
    assert [step for step, _ in complete_checkpoints(dump / "checkpoint")] == [stopped_at]
    assert "is in use" not in both and not (dump / OWNER_FILE).exists()
    assert_no_checkpoint_lacks_data(dump)


# -- one run per dump folder ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_on_a_live_runs_folder_refuses_and_a_killed_runs_folder_is_taken_over(runs, background):
    dump = runs / "shared"
    first = background(launcher(dump, "--training.steps=100000"))
    first.wait_for(r"step +2/100000")
    second = run(launcher(dump, "--training.steps=2"))
    assert second.returncode == 2
    owner = re.search(r"dump folder (\S+) is in use by the run started (.+) on host (\S+) \(pid (\d+)\)", second.stderr)
    assert owner and owner.group(1) == str(dump), second.stderr[-3000:]
    assert int(owner.group(4)) in _children(first.process.pid)  # rank 0 of the first run
    assert "Traceback" not in second.stderr and "ChildFailedError" not in second.stderr
    assert len(re.findall("is in use by", second.stderr)) == 1  # once, not once per rank

    first.kill_everything()  # SIGKILL: the owner file stays behind
    assert (dump / OWNER_FILE).exists()
    third = run(launcher(dump, "--training.steps=2", "--checkpoint.resume_from=none"))
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"dump folder {dump}: taken over from the run started {owner.group(2)}" in third.stderr
    assert "which is gone: no process" in third.stderr
    assert_no_checkpoint_lacks_data(dump)


# -- one clean message and exit code 2 per user error ----------------------------------------------


def assert_one_clean_error(result: subprocess.CompletedProcess, *key_words: str) -> None:
    console = result.stdout + result.stderr
    assert result.returncode == 2, console[-4000:]
    for words in key_words:
        assert words in console, f"{words!r} not in:\n{console[-4000:]}"
    assert "Traceback" not in console and "ChildFailedError" not in console, console[-4000:]
    assert len([line for line in console.splitlines() if key_words[0] in line]) == 1, console[-4000:]


@pytest.mark.slow
def test_config_errors_stop_before_any_worker_starts_naming_the_override(runs, capfd):
    dump = runs / "bad-config"
    assert_one_clean_error(
        run_in_process(launcher(dump, "--training.steps=0"), capfd),
        "config error: command-line override --training.steps=0: training.steps must be > 0",
    )
    assert_one_clean_error(
        run_in_process(launcher(dump, "--checkpoint.resume_from=step-7"), capfd),
        "command-line override --checkpoint.resume_from=step-7: checkpoint.resume_from = 'step-7': "
        f"checkpoint folder {dump.absolute() / 'checkpoint' / 'step-7'} does not exist",
    )
    assert not dump.exists()  # nothing started


@pytest.mark.slow
def test_a_model_that_does_not_fit_the_data_is_one_message(runs, capfd):
    dump = runs / "misfit"
    assert_one_clean_error(
        run_in_process(launcher(dump, "--model.in_channels=3"), capfd),
        "command-line override --model.in_channels=3: [model] does not fit [data]",
        "in_channels=3 but the data's latents have 1 channels",
    )
    assert not (dump / OWNER_FILE).exists()


@pytest.mark.slow
def test_an_error_on_a_rank_whose_output_is_hidden_is_shown_once_by_the_launcher(runs):
    result = run(launcher(runs / "rank1", script=FAULTY), fault="rank1_user_error")
    assert_one_clean_error(result, "rank 1: shard_00003.safetensors: caption_mask holds 7, expected 0 or 1")


@pytest.mark.slow
def test_an_internal_error_keeps_its_traceback_and_exit_code_1(runs):
    result = run(launcher(runs / "bug", script=FAULTY), fault="internal_error")
    assert result.returncode == 1
    assert "RuntimeError: an injected bug" in result.stderr and "Traceback" in result.stderr


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_names_the_newest_intact_one_and_the_flag_that_resumes_from_it(runs):
    dump = runs / "damaged"
    made = run(launcher(dump, "--training.steps=4", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"))
    assert made.returncode == 0, made.stderr[-3000:]
    shard = dump / "checkpoint" / "step-4" / "__1_0.distcp"
    os.truncate(shard, shard.stat().st_size // 2)
    result = run(launcher(dump, "--training.steps=6"))
    assert_one_clean_error(
        result,
        f"checkpoint shard {shard} is truncated",
        f"the newest earlier checkpoint with all its files is {dump / 'checkpoint' / 'step-2'}: resume from it "
        f"with --checkpoint.resume_from=step-2",
    )
    resumed = run(launcher(dump, "--training.steps=3", "--checkpoint.resume_from=step-2"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {dump.absolute() / 'checkpoint' / 'step-2'} at step 2" in resumed.stderr


@pytest.mark.slow
def test_a_full_disk_during_the_final_save_is_one_message_and_keeps_the_last_checkpoint(runs):
    dump = runs / "full-save"
    result = run(launcher(dump, "--training.steps=3", "--checkpoint.interval=2", script=FAULTY), fault="save_disk_full")
    assert_one_clean_error(
        result,
        "checkpoint step 3 was not saved",
        f"no space left on {dump / 'checkpoint'}: needs about",
        "rank 1: OSError: [Errno 28] No space left on device",
    )
    assert [step for step, _ in complete_checkpoints(dump / "checkpoint")] == []  # step 2's save failed alike
    assert_no_checkpoint_lacks_data(dump)


@pytest.mark.slow
def test_a_full_disk_during_the_digits_build_is_one_message(tmp_path):
    dump = tmp_path / "run"  # a fresh data folder beside it: the digits are built
    result = run(launcher(dump, script=FAULTY), fault="digits_disk_full")
    assert_one_clean_error(result, f"no space left on {tmp_path / 'data' / 'digits'}: needs about 8.05 MB")
    assert list((tmp_path / "data" / "digits").iterdir()) == []


@pytest.mark.slow
def test_skipped_non_finite_steps_are_counted_at_the_end(runs):
    result = run(launcher(runs / "nan", "--training.steps=3", script=FAULTY), fault="nonfinite_step_2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 of the 3 steps were skipped for a non-finite loss or gradient norm" in result.stderr
