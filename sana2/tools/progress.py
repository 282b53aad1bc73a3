"""A one-line progress display on stderr (tensors and bytes done), shown only on a terminal."""

import dataclasses
import sys
import time
from typing import Any

import torch

from sana2.formats.tensors import SourceTensor, map_tensors
from sana2.staging import human_bytes


class Progress:
    """Counts the tensors read and their bytes; redraws at most every `interval` seconds with a carriage return."""

    def __init__(self, label: str, tensors: list[SourceTensor], stream=None, interval: float = 0.2):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total_tensors, self.total_bytes = label, len(tensors), sum(t.nbytes for t in tensors)
        self.tensors = self.bytes = 0
        self.start = self.last_draw = time.monotonic()
        self.interval = interval

    def track(self, obj: Any) -> Any:
        """`obj` with each SourceTensor leaf counted when it is read."""

        def counted(source: SourceTensor | torch.Tensor, path: tuple) -> SourceTensor | torch.Tensor:
            if not isinstance(source, SourceTensor):
                return source

            def fill(out: torch.Tensor, start: int) -> None:
                source.fill(out, start)
                self.advance(out.numel() * out.element_size())

            return dataclasses.replace(source, fill=fill)

        return map_tensors(obj, counted)

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
