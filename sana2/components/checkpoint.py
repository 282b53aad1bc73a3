"""Sharded DCP checkpoints that appear atomically and survive crashes, kills and full disks.

Layout: `<dump_folder>/<checkpoint.folder>/step-<N>/` holds the DCP files (`.metadata`,
`__<rank>_0.distcp`), `config.json` (the resolved run config) and `COMPLETE`. A save writes into
`step-<N>.partial` and is renamed to `step-<N>` only after every rank's data and the metadata are
on disk and COMPLETE is written, so a checkpoint folder without `.partial` is always whole; an
interrupted save leaves only a `.partial` folder, which resume ignores and the next save removes.

This module knows nothing about models: the trainer hands it a state dict to save, and a template
to load into.
"""

import json
import os
import re
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from sana2.log import logger

COMPLETE_MARKER = "COMPLETE"
STEP_FOLDER = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder or file and the problem."""


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = STEP_FOLDER.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_checked_metadata(path: Path, require_complete: bool = True):
    """The DCP metadata of `path`, after checking every file it references is present and long enough."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a DCP checkpoint: {path / '.metadata'} is missing")
    if require_complete and not (path / COMPLETE_MARKER).is_file():
        raise CheckpointError(f"{path} is incomplete (no {COMPLETE_MARKER} marker): its save was interrupted")
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata fails to unpickle
        raise CheckpointError(f"{path / '.metadata'} is corrupt: {exc}") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint shard {file} is missing")
        if file.stat().st_size < size:
            raise CheckpointError(f"checkpoint shard {file} is truncated: {file.stat().st_size} bytes, "
                                  f"its metadata needs at least {size}")
    return metadata


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves every `interval` steps (sync or async), keeps the latest `keep_latest_k`, finds resumes."""

    def __init__(self, folder: Path, interval: int, keep_latest_k: int, async_mode: str, rank: int):
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.rank = rank
        self._pending: tuple[int, Future, dict[str, str]] | None = None
        # async saves talk on their own group: sharing the training group mismatches collectives
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" else None

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def partial_path(self, step: int) -> Path:
        return self.folder / f"step-{step}.partial"

    def final_path(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def save(self, step: int, state: dict, files: dict[str, str], blocking: bool = False) -> float:
        """Write `state` as checkpoint `step`; returns the seconds training was blocked."""
        start = time.perf_counter()
        self.wait()  # one save in flight at a time
        if (self.final_path(step) / COMPLETE_MARKER).is_file():
            return time.perf_counter() - start  # this exact state is already on disk
        partial = self.partial_path(step)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        if self.async_mode == "async" and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._async_group)
            self._pending = (step, future, files)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._finalize(step, files)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until an in-flight async save is complete and visible."""
        if self._pending is None:
            return
        step, future, files = self._pending
        self._pending = None
        future.result()
        self._finalize(step, files)

    def _finalize(self, step: int, files: dict[str, str]) -> None:
        """Rank 0 publishes the checkpoint: extra files, COMPLETE, fsync, atomic rename."""
        if self.rank == 0:
            partial = self.partial_path(step)
            for name, text in files.items():
                (partial / name).write_text(text)
            marker = {"step": step, "world_size": dist.get_world_size(), "time": time.time()}
            (partial / COMPLETE_MARKER).write_text(json.dumps(marker))
            for file in partial.iterdir():
                _fsync_path(file)
            os.replace(partial, self.final_path(step))
            _fsync_path(self.folder)
            logger.info(f"checkpoint saved: {self.final_path(step)}")
            self._apply_retention()

    def _apply_retention(self) -> None:
        complete = complete_checkpoints(self.folder)
        if self.keep_latest_k > 0:
            for _, path in complete[: -self.keep_latest_k]:  # the newest always survives
                shutil.rmtree(path, ignore_errors=True)
        in_flight = self.partial_path(self._pending[0]) if self._pending else None
        for path in self.folder.glob("step-*.partial"):
            if path != in_flight:
                shutil.rmtree(path, ignore_errors=True)  # left by an interrupted save

    def resume_path(self, resume_from: str) -> Path | None:
        """The checkpoint to resume from: the newest complete one ("latest"), none, or a given folder."""
        if resume_from == "none":
            return None
        if resume_from == "latest":
            complete = complete_checkpoints(self.folder)
            return complete[-1][1] if complete else None
        return Path(resume_from)

    def load(self, path: Path, template: dict) -> dict:
        """Load checkpoint `path` into `template` (tensors in place); returns the template."""
        metadata = read_checked_metadata(path)
        _check_model_entries(path, template, metadata)
        try:
            dcp.load(template, checkpoint_id=str(path))
        except Exception as exc:
            raise CheckpointError(f"loading checkpoint {path} failed: {exc}") from exc
        return template


def _check_model_entries(path: Path, template: dict, metadata) -> None:
    """Every model (and EMA) tensor this run needs is stored, with this run's shape."""
    stored = metadata.state_dict_metadata
    for section in ("model", "ema"):
        if section in template and not any(key.startswith(f"{section}.") for key in stored):
            raise CheckpointError(f"checkpoint {path} has no {section!r} state")
        for key, tensor in template.get(section, {}).items():
            entry = stored.get(f"{section}.{key}")
            if entry is None:
                raise CheckpointError(f"checkpoint {path} lacks {section}.{key} (a different model or options?)")
            if tuple(entry.size) != tuple(tensor.shape):
                raise CheckpointError(f"checkpoint {path}: {section}.{key} has shape {tuple(entry.size)}, "
                                      f"this model needs {tuple(tensor.shape)}")
