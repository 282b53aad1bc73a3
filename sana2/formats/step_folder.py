"""The step folder: what a checkpoint holds besides DCP's files, and the one writer of its COMPLETE marker.

    <checkpoint folder>/step-<N>/
        .metadata, __<rank>_0.distcp     DCP's files (ChecksummingWriter adds each data file's CRC32 list)
        config.json, config.toml         the resolved run config (--to-dcp: where the tensors came from)
        COMPLETE                         JSON: step, save sequence number, world size, checksums, time

The checkpoint manager (sana2/components/checkpoint.py) and `sana2-convert --to-dcp`
(sana2/tools/dcp_import.py) both finish their folders here, so both write the same layout. COMPLETE is
written last, after checking that every shard file the metadata names is there and long enough: a
folder with COMPLETE is whole. Publishing it (fsync, atomic rename) is the caller's, through
sana2/staging.py.
"""

import json
import re
import time
from pathlib import Path

from sana2.formats.dcp_folder import COMPLETE_MARKER, read_checked_metadata, read_marker

STEP_FOLDER = re.compile(r"^step-(\d+)$")


def step_folder_name(step: int) -> str:
    return f"step-{step}"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete step folder under `folder`, in the order they were saved."""
    if not Path(folder).is_dir():
        return []
    found = []
    for path in Path(folder).iterdir():
        match = STEP_FOLDER.match(path.name)
        if match and (path / COMPLETE_MARKER).is_file():
            found.append((read_marker(path).get("sequence", 0), int(match.group(1)), path))
    return [(step, path) for _, step, path in sorted(found)]


def next_sequence(folder: Path) -> int:
    """The save sequence number of the next checkpoint in `folder` (1 for the first)."""
    return 1 + max((read_marker(path).get("sequence", 0) for _, path in complete_checkpoints(folder)), default=0)


def finish_step_folder(folder: Path, step: int, world_size: int, files: dict[str, str], sequence: int) -> None:
    """Write `files` ({name: text}) into the DCP folder `folder`, check its shards, then write COMPLETE.

    Raises CheckpointError when a shard the metadata names is missing or short (nothing is marked complete).
    """
    folder = Path(folder)
    for name, text in files.items():
        (folder / name).write_text(text)
    read_checked_metadata(folder, require_complete=False)  # every shard it names is there, whole
    marker = {"step": step, "sequence": sequence, "world_size": world_size, "checksums": True, "time": time.time()}
    (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
