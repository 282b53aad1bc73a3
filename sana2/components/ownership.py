"""One run per dump folder: `<dump_folder>/owner.json` names the run that writes there.

Two runs saving into one folder interleave their checkpoints and overwrite each other's, so a run
takes the folder before any work and a second run refuses to start. The owner file appears in one
step, complete: it is written beside, then hard-linked into place, which fails if one exists (an
atomic create on local and network filesystems alike). Global rank 0 alone holds it, so a job holds
it once whatever its number of nodes.

A run that died without releasing it (SIGKILL, a lost node) must not block the folder forever:
- where the owner's pid can be checked (same kernel and pid namespace: the file records the boot id
  and the namespace), the owner is gone when its pid no longer runs the process that took the folder
  (the pid is free, or reused by a process started at another time: /proc/<pid>/stat's start time);
- elsewhere (another node), the owner refreshes the file's modification time every
  HEARTBEAT_SECONDS; one silent for STALE_AFTER_SECONDS is gone. Ages are measured on the
  filesystem's clock (against a file written just before), so clock skew between nodes does not count.
- a restarted worker group of the same torchrun job (same TORCHELASTIC_RUN_ID, restart count > 0)
  takes the folder from its previous attempt, whose processes the agent has stopped.
A gone owner's folder is taken over, and the run says so. Linux-only facts (/proc) are read where
present; elsewhere only the heartbeat decides.
"""

import json
import os
import socket
import threading
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from sana2.log import logger

OWNER_FILE = "owner.json"
HEARTBEAT_SECONDS = 30.0
# six missed heartbeats: long enough for a network filesystem's attribute cache (NFS: up to 60 s)
STALE_AFTER_SECONDS = 180.0


class DumpFolderInUse(RuntimeError):
    """Another live run owns the dump folder; the message names the folder and the owner."""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def this_machine() -> str:
    """Where pids mean the same thing: the kernel's boot id and this process's pid namespace ("" if unknown)."""
    boot_id = _read("/proc/sys/kernel/random/boot_id")
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    return f"{boot_id}/{namespace}" if boot_id and namespace else ""


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22); None if none runs."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # the command name (field 2) may hold spaces and parentheses: fields 3.. follow the last ")"
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Owner:
    host: str  # for people
    machine: str  # this_machine() of the owner: where its pid can be checked
    pid: int
    process_start: int  # tells the owner apart from a later process given the same pid
    started: str  # when the run took the folder, for people
    run_id: str  # TORCHELASTIC_RUN_ID ("" outside torchrun)
    token: str  # unique per taking: tells this run's file apart from a successor's

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(
            host=socket.gethostname(),
            machine=this_machine(),
            pid=os.getpid(),
            process_start=process_start(os.getpid()) or 0,
            started=datetime.now().isoformat(sep=" ", timespec="seconds"),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            token=uuid.uuid4().hex,
        )

    def describe(self) -> str:
        return f"the run started {self.started} on host {self.host} (pid {self.pid})"


def _load(path: Path) -> Owner | None:
    try:
        return Owner(**json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def why_gone(owner: Owner, heartbeat_age: float) -> str | None:
    """Why `owner` no longer runs, or None if it may still be running."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if owner.run_id and owner.run_id == os.environ.get("TORCHELASTIC_RUN_ID") and restart > 0:
        return f"it was attempt {restart - 1} of this job (run id {owner.run_id}), which torchrun restarted"
    if owner.machine and owner.machine == this_machine():
        if process_start(owner.pid) == owner.process_start:
            return None
        return f"no process {owner.pid} of that run is left on {owner.host}"
    if heartbeat_age < STALE_AFTER_SECONDS:
        return None
    return (
        f"its heartbeat stopped {heartbeat_age:.0f} s ago (a live run refreshes it every "
        f"{HEARTBEAT_SECONDS:.0f} s; {STALE_AFTER_SECONDS:.0f} s of silence count as gone)"
    )


def in_use_message(folder: Path, owner: Owner) -> str:
    return (
        f"dump folder {folder} is in use by {owner.describe()}: two runs in one folder overwrite each "
        f"other's checkpoints. Wait for that run to end or stop it, or choose another --job.dump_folder"
    )


class DumpFolderLock:
    """Takes a dump folder for this process (global rank 0), refreshes its heartbeat, releases it."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / OWNER_FILE
        self.owner = Owner.this_process()
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the folder, or raise DumpFolderInUse naming its live owner; a gone owner is taken over."""
        self.folder.mkdir(parents=True, exist_ok=True)
        staged = self.folder / f".{OWNER_FILE}.{self.owner.token}"
        staged.write_text(json.dumps(asdict(self.owner)))
        try:
            for _ in range(10):  # each pass takes the folder, raises, or sets a gone owner's file aside
                try:
                    os.link(staged, self.path)
                    break
                except FileExistsError:
                    self._set_aside_if_gone(now=staged.stat().st_mtime)
            else:
                raise DumpFolderInUse(
                    f"dump folder {self.folder}: could not take {self.path}: other runs keep taking it"
                )
        finally:
            staged.unlink()
        self._heartbeat = threading.Thread(target=self._beat, name="dump-folder-heartbeat", daemon=True)
        self._heartbeat.start()

    def _set_aside_if_gone(self, now: float) -> None:
        try:
            age = now - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        owner = _load(self.path)
        if owner is None:  # not sana2's, or written by a newer version: trust only its heartbeat
            if age < STALE_AFTER_SECONDS:
                raise DumpFolderInUse(
                    f"dump folder {self.folder} holds an owner file {self.path} this version cannot read, "
                    f"refreshed {age:.0f} s ago: another run may be using the folder; choose another "
                    f"--job.dump_folder, or delete that file if no run uses it"
                )
            owner = Owner("?", "", -1, 0, "at an unknown time", "", "")
        reason = why_gone(owner, age)
        if reason is None:
            raise DumpFolderInUse(in_use_message(self.folder, owner))
        # one rename: of runs taking over together, one succeeds
        aside = self.folder / f".{OWNER_FILE}.gone-{self.owner.token}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        moved = _load(aside)
        if moved is not None and moved.token != owner.token:
            # another run took the folder between our read and our rename: give its file back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        else:
            logger.warning(f"dump folder {self.folder}: taken over from {owner.describe()}, which is gone: {reason}")
        aside.unlink()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                current = _load(self.path)
                if current is not None and current.token == self.owner.token:
                    os.utime(self.path)
                    continue
            except OSError as exc:  # a transient error on a network filesystem: the next beat retries
                logger.warning(f"dump folder {self.folder}: heartbeat failed: {exc}")
                continue
            taker = current.describe() if current is not None else "nobody (the owner file is gone)"
            logger.error(f"dump folder {self.folder} is now owned by {taker} while this run writes there")

    def release(self) -> None:
        """Stop the heartbeat and remove the owner file, if it is still this run's."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        current = _load(self.path)
        if current is not None and current.token == self.owner.token:
            self.path.unlink(missing_ok=True)
