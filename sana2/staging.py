"""Stage-then-rename: every file or folder sana2 writes appears complete or not at all.

An output is written under a temporary name beside its final path, flushed to disk, and renamed
into place in one step, so a reader sees either the previous output or the whole new one. A crash,
a kill or a full disk leaves only a temporary name starting with "." that no reader takes for an
output. This is the one implementation used by datasets, converted checkpoints and training
checkpoints.

Before writing, every command claims its output path (`claim_output`): it may replace only its own
earlier output of the same kind, never a path that is, contains or lies inside one of its inputs,
and never a file or folder it did not write. A folder a command writes holds a marker file naming
the command and kind (`mark_output`); a file output carries its marker inside (a PNG text chunk,
safetensors metadata) or is recognised by the caller's `is_own`.
"""

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
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


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def no_space(path: str | os.PathLike, needed: int) -> NoSpaceError:
    free = free_bytes(path)
    # a write that failed with more free than its data: file headers and allocation blocks took the rest
    overhead = " and the filesystem's overhead" if free >= needed else ""
    return NoSpaceError(
        f"no space left on {path}: needs about {human_bytes(needed)}{overhead}, {human_bytes(free)} free"
    )


def ensure_free_space(path: str | os.PathLike, needed: int) -> None:
    """Raise NoSpaceError if the filesystem holding `path` (or its nearest existing parent) lacks `needed` bytes."""
    if needed > free_bytes(path):
        raise no_space(path, needed)


# ENOSPC and EDQUOT as libraries word them when they drop the errno: Python/C, Rust (safetensors), and
# torch.save's zip writer, which meets a full disk as a short write and says only that its position is off
_FULL_DISK_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122", "unexpected pos ")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an error it wraps: its cause, DCP's per-rank failures) reports a full disk or quota."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if isinstance(exc, NoSpaceError) or any(text in str(exc) for text in _FULL_DISK_TEXT):
        return True
    wrapped = [exc.__cause__, exc.__context__]
    wrapped += [failure[0] for failure in (getattr(exc, "failures", None) or {}).values()]
    return any(isinstance(inner, BaseException) and is_disk_full(inner) for inner in wrapped)


@contextmanager
def reporting_full_disk(path: str | os.PathLike, needed: int) -> Iterator[None]:
    """Turn a full disk met inside the block (whatever library met it) into one NoSpaceError that
    names `path`, the `needed` bytes and the bytes free once the block has cleaned up."""
    try:
        yield
    except Exception as exc:
        if is_disk_full(exc):
            raise no_space(path, needed) from None
        raise


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


def current_umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads' writes)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: Path) -> None:
    """Give a file, or every file and folder under a folder, the permissions the umask gives new ones.

    Some writers create their files private whatever the umask (safetensors: 0600, tempfile: 0700),
    which locks the rest of a shared group out of a dataset or checkpoint.
    """
    mask = current_umask()
    items = [path]
    if path.is_dir() and not path.is_symlink():
        for folder, folders, files in os.walk(path):  # links to folders are not followed
            items += [Path(folder, name) for name in folders + files]
    for item in items:
        if item.is_symlink():
            continue
        mode = item.stat().st_mode
        wanted = 0o777 if item.is_dir() else 0o666 | (mode & 0o111)
        if (mode & 0o7777) != wanted & ~mask:
            os.chmod(item, wanted & ~mask)


def publish(staged: Path, final: Path, replace: bool = False) -> None:
    """Give `staged` the umask's permissions, flush it to disk and rename it to `final` (a file or a folder).

    An existing `final` raises FileExistsError unless `replace`; then it is renamed aside first and
    deleted once the new one is in place, so `final` always names one complete output.
    """
    apply_umask(staged)
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


# -- claiming an output path ------------------------------------------------------------------------

# in every folder a sana2 command writes: {"kind": <command and kind>} (not hidden: hidden names are temporaries)
OUTPUT_MARKER = "sana2_output.json"


class OutputRefused(ValueError):
    """A command may not write this output path; the message names the path and why."""


def mark_output(folder: str | os.PathLike, kind: str, files: Iterable[str] | None = None) -> None:
    """Mark `folder` (about to be published, or created by the command) as an output of `kind`; with `files`
    (names in it), as holding those alone: a later claim refuses the folder if it holds anything else."""
    marker = {"kind": kind} if files is None else {"kind": kind, "files": sorted(files)}
    (Path(folder) / OUTPUT_MARKER).write_text(json.dumps(marker) + "\n")


def _marker(folder: str | os.PathLike) -> dict:
    try:
        marker = json.loads((Path(folder) / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def output_kind(folder: str | os.PathLike) -> str | None:
    """The kind a sana2 command marked `folder` with, or None (not a folder, or not marked)."""
    kind = _marker(folder).get("kind")
    return kind if isinstance(kind, str) else None


def foreign_entries(folder: str | os.PathLike) -> list[str]:
    """What a folder marked with its `files` holds besides them and its marker (someone else's), sorted."""
    listed = _marker(folder).get("files")
    if not isinstance(listed, list):
        return []
    return sorted(p.name for p in Path(folder).iterdir() if p.name not in {*listed, OUTPUT_MARKER})


def overlap(path: Path, other: Path) -> str | None:
    """How `path` overlaps `other` ("is", "contains", "lies inside"), both resolved (links followed), or None."""
    path, other = Path(os.path.realpath(path)), Path(os.path.realpath(other))
    if path == other:
        return "is"
    if path in other.parents:
        return "contains"
    if other in path.parents:
        return "lies inside"
    return None


def claim_output(
    path: str | os.PathLike,
    kind: str,
    inputs: Iterable[str | os.PathLike] = (),
    *,
    folder: bool = True,
    replace: bool = True,
    is_own: Callable[[Path], bool] | None = None,
    hint: str = "",
) -> bool:
    """Check that a command writing `kind` (a folder, or a file if not `folder`) may write `path`;
    return whether an earlier output of it is there, to be replaced.

    Refused (OutputRefused, naming the path and why): a path that is, contains or lies inside one of
    `inputs`; an existing path that is not this command's earlier output of `kind` (a folder marked
    by `mark_output` or empty, or what `is_own` recognises), or one holding what the command did not
    write (`mark_output`'s `files`); an earlier output when not `replace`
    (`hint` says how to allow it, e.g. "pass --overwrite to replace it").
    """
    path = Path(path)
    for source in inputs:
        relation = overlap(path, Path(source))
        if relation == "is":
            raise OutputRefused(f"refusing to write {path}: it is one of this command's inputs")
        if relation is not None:
            raise OutputRefused(
                f"refusing to write {path}: it {relation} the input {source}; choose an output outside the inputs"
            )
    writable = path if folder and path.is_dir() else path.parent
    while not writable.exists():
        writable = writable.parent
    if not os.access(writable, os.W_OK | os.X_OK):
        why = "a read-only filesystem, or no permission"
        raise OutputRefused(f"cannot write {path}: {writable} is not writable ({why})")
    if not (path.exists() or path.is_symlink()):
        return False
    is_folder = path.is_dir() and not path.is_symlink()
    if is_folder != folder:
        wanted, found = ("a folder", "a file") if folder else ("a file", "a folder")
        raise OutputRefused(f"refusing to write {path}: it is {found}, and this output is {wanted}")
    own = (is_own or (lambda p: output_kind(p) == kind))(path) or (folder and not any(path.iterdir()))
    if not own:
        raise OutputRefused(
            f"refusing to replace {path}: it is not an earlier {kind} output (choose another output, or "
            "delete it yourself if it is not needed)"
        )
    foreign = foreign_entries(path) if folder else []
    if foreign:
        raise OutputRefused(
            f"refusing to replace {path}: besides the earlier {kind} output it holds {', '.join(foreign[:3])}"
            f"{' and more' if len(foreign) > 3 else ''}, which {kind} did not write (move it, or choose another output)"
        )
    if not replace:
        raise OutputRefused(f"output {path} already exists{f' ({hint})' if hint else ''}")
    return True
