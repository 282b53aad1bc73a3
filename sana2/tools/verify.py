"""--verify: re-read what was written and compare it with the source checkpoint, one tensor at a time.

Tensors must match bit for bit: exactly when the dtype was kept, equal to the source cast to the
exported dtype otherwise (the cast is what the export wrote, so that comparison is exact too).
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sana2.tools.dcp_export import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    ExportPlan,
    accelerate_random_states,
    optimizer_structure,
    reference_metadata,
    rng_states,
)
from sana2.tools.dcp_import import output_dtype
from sana2.tools.dcp_source import DcpCheckpoint
from sana2.tools.full_checkpoint import SourceTensor
from sana2.tools.progress import human_bytes
from sana2.tools.safetensors_files import SafetensorsFile, safetensors_files
from sana2.tools.torch_files import ScratchBuffer, StoredTensor, TensorSlot, TorchArchive


class VerificationFailed(Exception):
    """The output differs from its source (the message names the first differences)."""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def same_value(a: Any, b: Any) -> bool:
    """Equality for checkpoint objects: tensors by bits, numpy arrays by value, containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class Comparison:
    """Counts what was checked and collects every difference."""

    def __init__(self):
        self.tensors = self.tensor_bytes = self.values = 0
        self.files: set[str] = set()
        self.problems: list[str] = []

    def tensor(self, where: str, got: torch.Tensor, expected: torch.Tensor) -> None:
        self.tensors += 1
        self.tensor_bytes += got.numel() * got.element_size()
        if not same_bits(got, expected):
            self.problems.append(
                f"{where}: differs ({tuple(got.shape)} {got.dtype} vs {tuple(expected.shape)} {expected.dtype})"
            )

    def value(self, where: str, got: Any, expected: Any) -> None:
        self.values += 1
        if not same_value(got, expected):
            self.problems.append(f"{where}: differs")

    def names(self, where: str, got, expected) -> None:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        if missing:
            self.problems.append(f"{where}: {len(missing)} tensors missing (first: {missing[0]})")
        if extra:
            self.problems.append(f"{where}: {len(extra)} unexpected tensors (first: {extra[0]})")

    def summary(self) -> str:
        checked = (
            f"{self.tensors} tensors ({human_bytes(self.tensor_bytes)}) and {self.values} other values "
            f"in {len(self.files)} file(s)"
        )
        if self.problems:
            shown = "; ".join(self.problems[:3])
            more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            raise VerificationFailed(f"verify FAILED: {len(self.problems)} differences in {checked}: {shown}{more}")
        return f"verify: {checked}: all equal to the source"


def compare_weights(
    check: Comparison,
    expected: list[tuple[str, Callable[[], torch.Tensor]]],
    outputs: list[tuple[str, dict[str, Callable[[ScratchBuffer], torch.Tensor]]]],
) -> None:
    """Each expected (name, read()) against every output {name: read(buffer)}; each source tensor is read once."""
    names = [name for name, _ in expected]
    for label, got in outputs:
        check.names(label, got, names)
    got_buffer = ScratchBuffer()
    for name, read_expected in expected:
        reference = read_expected()
        for label, got in outputs:
            if name in got:
                check.tensor(f"{label}: {name}", got[name](got_buffer), reference)


def _compare_tree(
    check: Comparison, where: str, got: Any, expected: Any, read_expected: Callable, got_buffer: ScratchBuffer
) -> None:
    """A torch.save file read lazily (StoredTensor leaves) against a structure with TensorSlot leaves."""
    if isinstance(expected, TensorSlot):
        if isinstance(got, StoredTensor):
            check.tensor(where, got.read(got_buffer), read_expected(expected))
        else:
            check.problems.append(f"{where}: expected a tensor, found {type(got).__name__}")
    elif isinstance(expected, dict) and isinstance(got, dict):
        if got.keys() != expected.keys():
            check.problems.append(f"{where}: keys differ")
        for key in expected.keys() & got.keys():
            _compare_tree(check, f"{where}.{key}", got[key], expected[key], read_expected, got_buffer)
    elif isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(expected):
        for index, (item, expected_item) in enumerate(zip(got, expected)):
            _compare_tree(check, f"{where}[{index}]", item, expected_item, read_expected, got_buffer)
    else:
        check.value(where, got, expected)


def _archive_tensors(archive: TorchArchive, *path: str) -> dict[str, Callable[[ScratchBuffer], torch.Tensor]]:
    node = archive.root
    for key in path:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    if not isinstance(node, dict):
        return {}
    return {name: stored.read for name, stored in node.items() if isinstance(stored, StoredTensor)}


def _expected_weights(plan: ExportPlan) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    return [(w.name, functools.partial(plan.read_weight, w)) for w in plan.weights]


def verify_pth(plan: ExportPlan, path: Path) -> str:
    check = Comparison()
    check.files.add(str(path))
    with TorchArchive.open(path) as archive:
        compare_weights(check, _expected_weights(plan), [(str(path), _archive_tensors(archive, "state_dict"))])
    return check.summary()


def verify_safetensors(plan: ExportPlan, target: Path) -> str:
    check = Comparison()
    files = [SafetensorsFile(path) for path in safetensors_files(target)]
    got = {name: functools.partial(file.read, name) for file in files for name in file.names()}
    compare_weights(check, _expected_weights(plan), [(str(target), got)])
    check.files.update(str(file.path) for file in files)
    for file in files:
        file.close()
    return check.summary()


def verify_accelerate(plan: ExportPlan, folder: Path, pth_path: Path) -> str:
    check = Comparison()
    model_dir = folder / "model"
    check.files.update([str(model_dir / MODEL_FILE), str(pth_path)])
    with TorchArchive.open(model_dir / MODEL_FILE) as model_file, TorchArchive.open(pth_path) as pth_file:
        compare_weights(
            check,
            _expected_weights(plan),
            [
                (str(model_dir / MODEL_FILE), _archive_tensors(model_file)),
                (str(pth_path), _archive_tensors(pth_file, "state_dict")),
            ],
        )
    source = plan.source
    if not plan.model_only and source.has("optimizer"):
        path = model_dir / OPTIMIZER_FILE
        check.files.add(str(path))
        with TorchArchive.open(path) as optimizer_file:
            _compare_tree(
                check,
                OPTIMIZER_FILE,
                optimizer_file.root,
                optimizer_structure(source),
                lambda slot: plan.read_state(slot.source),
                ScratchBuffer(),
            )
    expected_files = {folder / "metadata.pth": reference_metadata(plan)}
    if not plan.model_only:
        if source.has("lr_scheduler"):
            expected_files[model_dir / SCHEDULER_FILE] = source.nested("lr_scheduler")
        for rank, states in rng_states(source).items():
            expected_files[model_dir / f"random_states_{rank}.pkl"] = accelerate_random_states(states, plan.step)
    for path, expected in expected_files.items():
        check.files.add(str(path))
        # these small files hold RNG states (numpy arrays): written by this tool, read back in full
        check.value(path.name, torch.load(path, weights_only=False), expected)
    return check.summary()


def verify_dcp(tensors: list[SourceTensor], folder: Path, dtype: torch.dtype | None) -> str:
    """A --to-dcp output folder against the single-file input it was made from."""
    check = Comparison()
    check.files.add(str(folder))
    read_buffer, cast_buffer = ScratchBuffer(), ScratchBuffer()

    def read_expected(tensor: SourceTensor) -> torch.Tensor:
        stored = tensor.read(read_buffer)
        cast = cast_buffer.tensor(tensor.shape, output_dtype(tensor, dtype))
        return cast.copy_(stored)

    with DcpCheckpoint(folder) as written:
        got = {path[1]: functools.partial(written.read_tensor, key) for key, path in written.paths("model").items()}
        expected = [(t.name, functools.partial(read_expected, t)) for t in tensors]
        compare_weights(check, expected, [(str(folder), got)])
        check.value("train_state", written.nested("train_state"), {"step": 0, "epoch": 0, "skipped_steps": 0})
    return check.summary()
