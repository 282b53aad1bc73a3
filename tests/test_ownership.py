"""One run per dump folder: the owner file, live and gone owners, take-overs, the heartbeat."""

import json
import os
import subprocess
import sys
import time

import pytest

from sana2.components import ownership
from sana2.components.ownership import OWNER_FILE, DumpFolderInUse, DumpFolderLock, Owner, process_start


def _write_owner(folder, age_seconds=0.0, **fields):
    owner = Owner(
        **{
            "host": "node-7",
            "machine": ownership.this_machine(),
            "pid": os.getpid(),
            "process_start": process_start(os.getpid()),
            "started": "2025-01-01 10:00:00",
            "run_id": "",
            "token": "theirs",
            **fields,
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / OWNER_FILE
    path.write_text(json.dumps(owner.__dict__))
    if age_seconds:
        then = time.time() - age_seconds
        os.utime(path, (then, then))
    return path


def _dead_pid() -> tuple[int, int]:
    """The pid and start time of a process that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(child.pid)
    child.wait()
    return child.pid, start


def test_a_run_takes_the_folder_and_releases_it(tmp_path):
    lock = DumpFolderLock(tmp_path / "dump")
    lock.acquire()
    recorded = json.loads((tmp_path / "dump" / OWNER_FILE).read_text())
    assert recorded["pid"] == os.getpid() and recorded["process_start"] == process_start(os.getpid())
    assert [p.name for p in (tmp_path / "dump").iterdir()] == [OWNER_FILE]  # the staged copy is gone
    lock.release()
    assert list((tmp_path / "dump").iterdir()) == []


def test_a_second_run_is_refused_naming_the_folder_and_the_owner(tmp_path):
    first = DumpFolderLock(tmp_path)
    first.acquire()
    with pytest.raises(DumpFolderInUse) as refused:
        DumpFolderLock(tmp_path).acquire()
    message = str(refused.value)
    assert f"dump folder {tmp_path} is in use by the run started {first.owner.started}" in message
    assert f"on host {first.owner.host} (pid {os.getpid()})" in message and "--job.dump_folder" in message
    first.release()
    DumpFolderLock(tmp_path).acquire()  # free again


def test_an_owner_whose_process_is_gone_is_taken_over_with_a_message(tmp_path, sana2_log):
    pid, start = _dead_pid()
    _write_owner(tmp_path, pid=pid, process_start=start)
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / OWNER_FILE).read_text())["token"] == lock.owner.token
    assert f"taken over from the run started 2025-01-01 10:00:00 on host node-7 (pid {pid}), which is gone" in (
        sana2_log.text
    )
    assert f"no process {pid} of that run is left" in sana2_log.text


def test_a_reused_pid_does_not_keep_a_gone_owner_alive(tmp_path):
    _write_owner(tmp_path, process_start=process_start(os.getpid()) - 1)  # our pid, another process's start
    DumpFolderLock(tmp_path).acquire()


def test_an_owner_on_another_machine_is_judged_by_its_heartbeat(tmp_path, sana2_log):
    _write_owner(tmp_path, machine="another-boot/pid:[1]", pid=1, age_seconds=60)
    with pytest.raises(DumpFolderInUse, match="on host node-7 \\(pid 1\\)"):
        DumpFolderLock(tmp_path).acquire()
    _write_owner(tmp_path, machine="another-boot/pid:[1]", pid=1, age_seconds=ownership.STALE_AFTER_SECONDS + 5)
    DumpFolderLock(tmp_path).acquire()
    assert "its heartbeat stopped 18" in sana2_log.text


def test_a_restarted_worker_group_of_the_same_job_takes_the_folder_back(tmp_path, monkeypatch):
    _write_owner(tmp_path, run_id="job-42")  # alive (this very process) but from the job's first attempt
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(DumpFolderInUse):  # a new job that happens to reuse the run id is refused
        DumpFolderLock(tmp_path).acquire()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    DumpFolderLock(tmp_path).acquire()


def test_an_unreadable_owner_file_counts_only_by_its_age(tmp_path):
    (tmp_path / OWNER_FILE).write_text("{not json")
    with pytest.raises(DumpFolderInUse, match="cannot read"):
        DumpFolderLock(tmp_path).acquire()
    then = time.time() - ownership.STALE_AFTER_SECONDS - 5
    os.utime(tmp_path / OWNER_FILE, (then, then))
    DumpFolderLock(tmp_path).acquire()


def test_release_leaves_a_successors_file_alone(tmp_path):
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    path = _write_owner(tmp_path, token="successor")
    lock.release()
    assert json.loads(path.read_text())["token"] == "successor"


def test_the_heartbeat_refreshes_the_owner_file(tmp_path, monkeypatch):
    monkeypatch.setattr(ownership, "HEARTBEAT_SECONDS", 0.05)
    lock = DumpFolderLock(tmp_path)
    lock.acquire()
    path = tmp_path / OWNER_FILE
    os.utime(path, (0, 0))
    deadline = time.time() + 5
    while path.stat().st_mtime == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert path.stat().st_mtime > time.time() - 60, "no heartbeat within 5 s"
    lock.release()
    assert not path.exists()
