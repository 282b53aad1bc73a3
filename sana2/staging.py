"""Stage-then-rename: every file or folder sana2 writes appears complete or not at all.

An output is written under a temporary name beside its final path, flushed to disk, and renamed
into place in one step, so a reader sees either the previous output or the whole new one. A crash,
a kill or a full disk leaves only a temporary name starting with "." that no reader takes for an
output. This is the one implementation used by datasets, converted checkpoints and training
checkpoints.
"""

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def human_bytes(count: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as disk sizes are sold)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class NoSpaceError(OSError):
    """Not enough free disk space for an output; the message names the path, the bytes needed and free."""


def ensure_free_space(path: str | os.PathLike, needed: int) -> None:
    """Raise NoSpaceError if the filesystem holding `path` (or its nearest existing parent) lacks `needed` bytes."""
    probe = Path(os.path.abspath(path))
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise NoSpaceError(f"no space left on {path}: needs about {human_bytes(needed)}, {human_bytes(free)} free")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data, or a folder's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and folder under a folder (the folders last, so their entries are final).

    A symbolic link has no data of its own: its entry is made durable by fsyncing the folder holding it.
    """
    if path.is_symlink():
        return
    if not path.is_dir():
        fsync_path(path)
        return
    for child in path.iterdir():
        fsync_tree(child)
    fsync_path(path)


def remove(path: Path) -> None:
    """Delete a file, link or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def temporary_sibling(final: Path, tag: str = "partial") -> Path:
    """A hidden name beside `final` that is unique to this process: `.<name>.<tag>-<pid>`."""
    return final.with_name(f".{final.name}.{tag}-{os.getpid()}")


def publish(staged: Path, final: Path, replace: bool = False) -> None:
    """Flush `staged` to disk and rename it to `final` (a file or a folder).

    An existing `final` raises FileExistsError unless `replace`; then it is renamed aside first and
    deleted once the new one is in place, so `final` always names one complete output.
    """
    fsync_tree(staged)
    aside = None
    if final.exists() or final.is_symlink():
        if not replace:
            raise FileExistsError(f"{final} already exists")
        aside = temporary_sibling(final, "old")
        remove(aside)
        os.rename(final, aside)
    os.rename(staged, final)
    fsync_path(final.parent)
    if aside is not None:
        remove(aside)


@contextmanager
def staged(final: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write `final`'s content to; publish it on success, delete it on failure.

    The caller creates the file or folder at the yielded path. An existing `final` is an error
    (FileExistsError, before anything is written) unless `replace`.
    """
    final = Path(final)
    if not replace and (final.exists() or final.is_symlink()):
        raise FileExistsError(f"{final} already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = temporary_sibling(final)
    remove(temp)
    try:
        yield temp
        publish(temp, final, replace)
    except BaseException:
        remove(temp)
        raise
