"""Sharded DCP checkpoints that appear atomically and survive crashes, kills, full disks and bit rot.

Layout: `<dump_folder>/<checkpoint.folder>/step-<N>/` holds the DCP files (`.metadata`,
`__<rank>_0.distcp`), a CRC32 list beside each data file (`__<rank>_0.distcp.crc32.json`), the
files the trainer adds (the resolved config) and `COMPLETE`. A save writes into
`step-<N>.partial`, and rank 0 renames it to `step-<N>` only after every rank's data and the
metadata are on disk and COMPLETE is written, so a `step-<N>` folder is always whole. An
interrupted save leaves only a `.partial` folder: resume ignores it and the next save removes it.
An async save is published by rank 0 from its writer thread as soon as every rank's data is written.

COMPLETE records a save sequence number; "latest" means the most recently saved checkpoint, not
the highest step, so a run resumed from an older checkpoint never falls back onto the abandoned
later ones, and retention never deletes the checkpoint it has just written.

Rank 0 checks, before a save, that the filesystem has room for it (the bytes every rank writes,
summed), and before writing COMPLETE, that every shard file the metadata names is there and long
enough. A failed save (a full disk, an I/O error on any rank) is discarded without touching the
complete checkpoints; a full disk is reported as such ("no space left on <folder>", the bytes
needed and free), whichever library met it. During training a failed save is logged as an error
and training goes on (the next interval tries again: a transient failure costs one interval, and a
restart could do no better than resume from the same previous checkpoint). A final save (end of
training, a stop signal) that fails raises CheckpointError, since the run's last state would
otherwise be lost without notice.

A load checks the folder first: every shard file its `.metadata` names is there and long enough,
with its CRC32 list. A damaged checkpoint (DamagedCheckpointError) names the newest earlier one
whose files are whole, and the flag to resume from it.

DCP reads flipped bytes inside a tensor without complaint; the CRC32 lists let a load name the
file and the key of a corrupt item instead of training on garbage. Writing and checking them, and
the checks of a folder before a load, live with the rest of the file layer in
sana2/formats/dcp_folder.py; publishing (fsync, then rename) is sana2/staging.py's.

This module knows nothing about models: the trainer hands it its state as Stateful objects
(`states={"model": ..., "optimizer": ..., "lr_scheduler": ..., ...}`); a save calls each one's
state_dict(), a load fills those state dicts through DCP and hands each back to its object's
load_state_dict(), in the order given (the optimizer before the lr scheduler, which sets the lr).
A plain dict may stand in for a Stateful: it is saved as is and loaded in place.
"""

import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from sana2 import staging
from sana2.formats.dcp_folder import (
    COMPLETE_MARKER,
    ChecksummingWriter,
    failures_text,
    load_verified,
    read_checked_metadata,
    read_marker,
    stored_shapes,
)
from sana2.formats.step_folder import (
    STEP_FOLDER,
    complete_checkpoints,
    finish_step_folder,
    next_sequence,
    step_folder_name,
)
from sana2.formats.tensors import CheckpointError, DamagedCheckpointError, check_shapes
from sana2.log import logger

__all__ = ["COMPLETE_MARKER", "CheckpointError", "CheckpointManager", "ChecksummingWriter", "complete_checkpoints"]

# left by an interrupted save: its partial folder, or a replaced checkpoint set aside by staging.publish
STALE_FOLDER = re.compile(r"^(step-\d+\.(partial|replaced)|\.step-\d+\.old-\d+)$")


class PerRankStateful(Stateful):
    """A Stateful whose entries belong to ranks (e.g. "rank3": that rank's RNG streams).

    A load leaves out the entries the checkpoint does not hold (ranks that did not exist when it
    was saved, i.e. a resume at a larger world size): load_state_dict gets only what was found.
    """


def state_dicts(states: dict) -> dict:
    """{name: state dict} of Stateful objects (plain dicts pass through)."""
    return {name: obj.state_dict() if isinstance(obj, Stateful) else obj for name, obj in states.items()}


# -- checking checkpoints ----------------------------------------------------------------------


def check_template_matches(path: Path, template: dict, metadata) -> None:
    """Every entry the template needs is stored with its shape; no model/EMA tensor is left over.

    Raises one CheckpointError listing the mismatched keys: a checkpoint of another model or
    other options must not load partially.
    """
    stored = stored_shapes(metadata)
    flat, _ = flatten_state_dict(template)
    for section in ("model", "ema"):
        if section in template and not any(key.startswith(f"{section}.") for key in stored):
            raise CheckpointError(f"checkpoint {path} has no {section!r} state")
    needed = {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None for key, value in flat.items()}
    sections = tuple(f"{section}." for section in ("model", "ema") if section in template)
    check_shapes(f"checkpoint {path}", stored, needed, unexpected=lambda key: key.startswith(sections))


# -- saving -------------------------------------------------------------------------------------


@dataclass
class _AsyncSave:
    """An async save in flight: rank 0 publishes it from the writer thread as soon as it is written."""

    step: int
    future: Future
    files: dict[str, str]
    published: threading.Event = field(default_factory=threading.Event)
    publish_failure: str | None = None


class CheckpointManager:
    """Saves every `interval` steps (sync or async), keeps the latest `keep_latest_k`, finds resumes."""

    def __init__(
        self,
        folder: Path,
        interval: int,
        keep_latest_k: int,
        async_mode: str,
        rank: int,
        states: dict | None = None,
        files: dict[str, str] | None = None,
    ):
        """`states`: what save and load handle by default; `files`: {name: text} added to every save."""
        self.folder = Path(folder)
        self.states = states or {}
        self.files = files or {}
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.async_mode = async_mode
        self.rank = rank
        self._pending: _AsyncSave | None = None
        self._needed = 0  # bytes the save in progress writes, over all ranks
        # the step whose state this run already has on disk (saved or loaded): saving it again is a no-op
        self._step_on_disk: int | None = None
        # async saves talk on their own group: sharing the training group mismatches collectives
        self._async_group = dist.new_group(backend="gloo") if async_mode == "async" else None

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def partial_path(self, step: int) -> Path:
        return self.folder / f"{step_folder_name(step)}.partial"

    def final_path(self, step: int) -> Path:
        return self.folder / step_folder_name(step)

    def save(self, step: int, states: dict | None = None, files: dict | None = None, final: bool = False) -> float:
        """Write `states` (default: the manager's) and `files` as checkpoint `step`; returns the
        seconds training was blocked.

        A final save is synchronous and raises CheckpointError if it fails; any other failed save
        is logged and discarded (see the module docstring).
        """
        start = time.perf_counter()
        files = self.files if files is None else files
        self.wait()  # one save in flight at a time
        on_disk = step == self._step_on_disk and (self.final_path(step) / COMPLETE_MARKER).is_file()
        if self._agreed(on_disk if self.rank == 0 else None):  # rank 0 looks: shared filesystems can lag
            return time.perf_counter() - start  # this exact state is already on disk
        state = state_dicts(self.states if states is None else states)
        self._needed = self._bytes_to_write(state)
        failure = self._agreed(self._prepare_partial(step) if self.rank == 0 else None)
        if failure is not None:
            self._conclude(step, failure, final)
            return time.perf_counter() - start
        writer = ChecksummingWriter(self.partial_path(step))
        if self.async_mode == "async" and not final:
            # one copy per tensor; the writer's own staging (BlockingAsyncStager) copies each DTensor three times
            stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
            future = dcp.async_save(
                state,
                checkpoint_id=str(self.partial_path(step)),
                storage_writer=writer,
                async_stager=stager,
                process_group=self._async_group,
            )
            future.add_done_callback(lambda _: stager.close())  # frees the staged copy
            self._pending = _AsyncSave(step, future, files)
            if self.rank == 0:
                future.add_done_callback(lambda _, pending=self._pending: self._publish_when_written(pending))
            return time.perf_counter() - start
        full_disk = False
        try:
            dcp.save(state, checkpoint_id=str(self.partial_path(step)), storage_writer=writer)
            failure = self._publish(step, files) if self.rank == 0 else None
        except CheckpointException as exc:  # raised on every rank alike
            failure, full_disk = failures_text(exc), _disk_full(exc)
        self._conclude(step, failure, final, full_disk)
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until an in-flight async save is published (or discarded, if it failed)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        failure, full_disk = None, False
        try:
            pending.future.result()
        except CheckpointException as exc:
            failure, full_disk = failures_text(exc), _disk_full(exc)
        if self.rank == 0:
            pending.published.wait()
            failure = failure or pending.publish_failure
        self._conclude(pending.step, failure, False, full_disk)

    def _agreed(self, value):
        """Rank 0's value (an outcome, a finding on disk), known to every rank: rank 0 alone does the
        file operations, and ranks reading a shared filesystem on their own could disagree."""
        outcome = [value]
        dist.broadcast_object_list(outcome, src=0)
        return outcome[0]

    def _bytes_to_write(self, state: dict) -> int:
        """About how many bytes all ranks together write for `state` (collective)."""
        local = 0
        for value in flatten_state_dict(state)[0].values():
            if isinstance(value, DTensor):  # a shard replicated over some mesh dimensions is written once
                copies = 1
                for dim, placement in enumerate(value.placements):
                    copies *= value.device_mesh.size(dim) if placement.is_replicate() else 1
                local += value.to_local().nbytes // copies
            elif isinstance(value, torch.Tensor) and self.rank == 0:  # the same on every rank: written once
                local += value.nbytes
        total = torch.tensor(local, dtype=torch.int64)
        dist.all_reduce(total)
        return int(total.item())

    def _prepare_partial(self, step: int) -> str | None:
        """Rank 0: remove what interrupted saves left, check the free space, create the empty partial folder."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for path in self.folder.iterdir():
                if STALE_FOLDER.match(path.name):
                    shutil.rmtree(path, ignore_errors=True)
            staging.ensure_free_space(self.folder, self._needed)
            self.partial_path(step).mkdir()
        except staging.NoSpaceError as exc:
            return str(exc)
        except OSError as exc:
            return f"rank 0: {type(exc).__name__}: {exc}"
        return None

    def _publish_when_written(self, pending: _AsyncSave) -> None:
        """Rank 0, in the async writer thread: publish as soon as every rank's data is on disk."""
        try:
            if pending.future.exception() is None:
                pending.publish_failure = self._publish(pending.step, pending.files)
        except Exception as exc:  # a callback's exception would vanish: report it as the save's failure
            pending.publish_failure = f"rank 0: {type(exc).__name__}: {exc}"
        finally:
            pending.published.set()

    def _publish(self, step: int, files: dict[str, str]) -> str | None:
        """Rank 0 makes the written checkpoint visible: extra files and COMPLETE (sana2/formats/step_folder.py),
        fsync, atomic rename.

        Returns None, or what failed (the partial folder is then left for `_conclude` to discard).
        """
        partial, final = self.partial_path(step), self.final_path(step)
        try:
            finish_step_folder(partial, step, dist.get_world_size(), files, next_sequence(self.folder))
            # flushed, then renamed; a checkpoint of the same step from an abandoned run is replaced
            staging.publish(partial, final, replace=True)
        except CheckpointError as exc:
            return f"rank 0: {exc}"
        except OSError as exc:
            return f"rank 0: {type(exc).__name__}: {exc}"
        logger.info(f"checkpoint saved: {final}")
        self._apply_retention(newest=final)
        return None

    def _conclude(self, step: int, failure: str | None, final: bool, full_disk: bool = False) -> None:
        """Record a successful save, or discard a failed one: logged, or raised if it was final.

        Collective. Rank 0's view decides (it publishes, and DCP hands it every rank's failure); it
        also tells a full disk from other failures: one named so, or a folder that, once the failed
        save is discarded, has less room than the save needs.
        """
        if self.rank == 0 and failure is not None:
            shutil.rmtree(self.partial_path(step), ignore_errors=True)  # frees what a full disk needs back
            if not failure.startswith("no space left") and (
                full_disk or staging.free_bytes(self.folder) < self._needed
            ):
                failure = f"{staging.no_space(self.folder, self._needed)} ({failure})"
        failure = self._agreed(failure)
        if failure is None:
            self._step_on_disk = step
            return
        complete = complete_checkpoints(self.folder)
        kept = f"the latest complete checkpoint {complete[-1][1]} is intact" if complete else "no checkpoint exists yet"
        message = f"checkpoint step {step} was not saved ({self.partial_path(step)} discarded; {kept}): {failure}"
        if final:
            raise CheckpointError(message)
        if self.rank == 0:
            logger.error(f"{message}; training continues and the next interval saves again")

    def _apply_retention(self, newest: Path) -> None:
        if self.keep_latest_k <= 0:
            return
        complete = complete_checkpoints(self.folder)
        for _, path in complete[: -self.keep_latest_k]:
            if path != newest:  # the checkpoint just written always survives
                shutil.rmtree(path, ignore_errors=True)

    # -- loading ----------------------------------------------------------------------------------
    def resume_path(self, resume_from: str) -> Path | None:
        """The checkpoint to resume from: the latest saved complete one ("latest"), none, or a given folder."""
        if resume_from == "none":
            return None
        if resume_from == "latest":
            complete = complete_checkpoints(self.folder) if self.rank == 0 else None
            return self._agreed(complete[-1][1] if complete else None)
        return Path(resume_from)

    def load(self, path: Path, states: dict | None = None) -> dict:
        """Load checkpoint `path` into `states` (default: the manager's); returns the state dicts loaded.

        Every entry a state needs must be stored with its shape (PerRankStateful entries excepted),
        or nothing is loaded; a state that rejects what it gets (load_state_dict raising ValueError)
        becomes a CheckpointError naming the checkpoint.
        """
        path = Path(path)
        states = self.states if states is None else states
        metadata = read_checked_metadata(path)
        template = state_dicts(states)
        stored = metadata.state_dict_metadata
        for name, obj in states.items():
            if isinstance(obj, PerRankStateful):
                template[name] = {
                    key: value for key, value in template[name].items() if _holds(stored, f"{name}.{key}")
                }
        check_template_matches(path, template, metadata)
        load_verified(path, template, require_checksums=bool(read_marker(path).get("checksums")))
        for name, obj in states.items():
            if isinstance(obj, Stateful):
                try:
                    obj.load_state_dict(template[name])
                except ValueError as exc:
                    raise CheckpointError(f"checkpoint {path}: {exc}") from None
        if path.resolve().parent == self.folder.resolve() and STEP_FOLDER.match(path.name):
            self._step_on_disk = int(STEP_FOLDER.match(path.name).group(1))
        return template

    def resume(self, resume_from: str | Path) -> Path | None:
        """Load the manager's states from the checkpoint `resume_from` names; returns its path, or
        None when there is nothing to resume ("none", or "latest" before the first save).

        A damaged checkpoint (files missing, short or corrupt) raises DamagedCheckpointError naming
        the newest earlier checkpoint of this run whose files are whole, and the flag to resume from it.
        """
        path = self.resume_path(str(resume_from))
        if path is None:
            return None
        try:
            self.load(path)
        except DamagedCheckpointError as exc:
            hint = self._agreed(self._earlier_intact_hint(path) if self.rank == 0 else None)
            raise DamagedCheckpointError(f"{exc}; {hint}") from None
        return path

    def _earlier_intact_hint(self, damaged: Path) -> str:
        """Rank 0: which checkpoint to resume from instead of `damaged`, as a sentence with the flag."""
        saved = [path for _, path in complete_checkpoints(self.folder)]
        resolved = [path.resolve() for path in saved]
        earlier = saved[: resolved.index(damaged.resolve())] if damaged.resolve() in resolved else saved
        for path in reversed(earlier):
            try:
                read_checked_metadata(path)
            except CheckpointError:
                continue
            return (
                f"the newest earlier checkpoint with all its files is {path}: resume from it with "
                f"--checkpoint.resume_from={path.name}"
            )
        return (
            f"{self.folder} holds no earlier checkpoint with all its files: --checkpoint.resume_from=none starts over"
        )


def _disk_full(exc: CheckpointException) -> bool:
    """Whether any rank's failure in a DCP save was a full disk."""
    return any(staging.is_disk_full(error) for error, _ in exc.failures.values())


def _holds(stored_keys, key: str) -> bool:
    """Whether the flattened checkpoint keys hold `key` or entries under it."""
    return any(stored == key or stored.startswith(f"{key}.") for stored in stored_keys)
