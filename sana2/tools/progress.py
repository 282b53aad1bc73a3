"""A one-line progress display on stderr (tensors and bytes done), shown only on a terminal."""

import sys
import time


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class Progress:
    """Counts tensors and bytes; redraws at most every `interval` seconds with a carriage return."""

    def __init__(self, label: str, total_tensors: int, total_bytes: int, stream=None, interval: float = 0.2):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total_tensors, self.total_bytes = label, total_tensors, total_bytes
        self.tensors = self.bytes = 0
        self.start = self.last_draw = time.monotonic()
        self.interval = interval

    def advance(self, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last_draw >= self.interval or self.tensors == self.total_tensors):
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self.start, 1e-9)
        fraction = self.bytes / self.total_bytes if self.total_bytes else 1.0
        bar = "#" * int(24 * fraction)
        self.stream.write(
            f"\r{self.label} [{bar:<24}] {self.tensors}/{self.total_tensors} tensors "
            f"{human_bytes(self.bytes)}/{human_bytes(self.total_bytes)} {human_bytes(rate)}/s "
        )
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled and self.tensors:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
