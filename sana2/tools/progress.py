"""The converters' progress bar: tqdm over the bytes of the tensors read, shown only on a terminal."""

import dataclasses
import sys
from typing import Any

import torch
from tqdm import tqdm

from sana2.formats.tensors import SourceTensor, map_tensors


def progress_bar(label: str, tensors: list[SourceTensor], file=None) -> tqdm:
    """A tqdm bar over the bytes of `tensors` on `file` (stderr); disable=None hides it off a terminal."""
    return tqdm(
        total=sum(t.nbytes for t in tensors),
        desc=label,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=file if file is not None else sys.stderr,
        disable=None,
        mininterval=0.2,
    )


def tracked(obj: Any, bar: tqdm) -> Any:
    """`obj` with each SourceTensor leaf advancing `bar` by its bytes as they are read."""

    def counted(source: SourceTensor | torch.Tensor, path: tuple) -> SourceTensor | torch.Tensor:
        if not isinstance(source, SourceTensor):
            return source

        def fill(out: torch.Tensor, start: int) -> None:
            source.fill(out, start)
            bar.update(out.numel() * out.element_size())

        return dataclasses.replace(source, fill=fill)

    return map_tensors(obj, counted)
