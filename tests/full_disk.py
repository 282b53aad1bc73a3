"""A disk that fills in the middle of a write, at the lowest public write point of DCP's writer."""

import errno
import io
import os
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint import filesystem


class FullDisk(io.RawIOBase):
    """A file on a disk with `room` bytes left: the write that fills it is short (as write(2) is), the
    next one fails with ENOSPC. torch.save's zip writer sees the short write as a wrong position."""

    def __init__(self, file, room: int):
        self.file, self.room = file, room

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        count = min(len(data), self.room)
        self.file.write(bytes(data)[:count])
        self.room -= count
        return count

    def tell(self) -> int:
        return self.file.tell()

    def seek(self, *args) -> int:
        return self.file.seek(*args)

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()


def torch_save_short_write_error() -> RuntimeError:
    """What torch.save says when a full disk cuts a write short: "unexpected pos N vs M", no errno."""
    try:
        torch.save(torch.zeros(10_000), FullDisk(io.BytesIO(), room=500))
    except RuntimeError as exc:
        return exc
    raise AssertionError("torch.save did not notice the short write")


def fill_disk_in_dcp_data_files(monkeypatch, room: int = 500) -> None:
    """Every DCP data file (.distcp) written from now on meets a full disk after `room` bytes."""
    create_stream = filesystem.FileSystem.create_stream

    @contextmanager
    def full(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield FullDisk(stream, room) if str(path).endswith(".distcp") and "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full)
