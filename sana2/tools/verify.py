"""--verify: re-read what was written and compare it with the source checkpoint, one tensor at a time.

Tensors must match bit for bit: exactly when the dtype was kept, equal to the source cast to the
exported dtype otherwise (the cast is what the export wrote, so that comparison is exact too).
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sana2.cli import CONFIG_JSON
from sana2.components.train_state import TrainState
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.diffusers_folder import NULL_CAPTION_NAME, STEM
from sana2.formats.safetensors_file import read_safetensors, read_safetensors_checkpoint, safetensors_files
from sana2.formats.tensors import SourceTensor
from sana2.formats.torch_file import read_torch_file
from sana2.staging import human_bytes
from sana2.tools.export import ExportPlan, diffusers_export_tensors, small_files
from sana2.tools.sana_layout import MODEL_DIR, MODEL_FILE, OPTIMIZER_FILE


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
    """Compares written structures with their sources, counting what was checked and collecting every difference."""

    def __init__(self):
        self.tensors = self.tensor_bytes = self.values = 0
        self.files: set[str] = set()
        self.problems: list[str] = []

    def tree(self, where: str, got: Any, expected: Any) -> None:
        """A structure read back (SourceTensor leaves) against the one that was written."""
        if isinstance(expected, SourceTensor):
            if not isinstance(got, SourceTensor):
                self.problems.append(f"{where}: expected a tensor, found {type(got).__name__}")
                return
            self.tensors += 1
            self.tensor_bytes += expected.nbytes
            if got.shape != expected.shape or got.dtype != expected.dtype:
                self.problems.append(f"{where}: is {got.shape} {got.dtype}, expected {expected.shape} {expected.dtype}")
            elif not same_bits(expected.read(), got.read()):  # one at a time: the source's read needs more memory
                self.problems.append(f"{where}: differs")
        elif isinstance(expected, dict) and isinstance(got, dict):
            missing, extra = [k for k in expected if k not in got], [k for k in got if k not in expected]
            if missing:
                self.problems.append(f"{where}: {len(missing)} entries missing (first: {missing[0]})")
            if extra:
                self.problems.append(f"{where}: {len(extra)} unexpected entries (first: {extra[0]})")
            for key in expected:
                if key in got:
                    self.tree(f"{where}.{key}", got[key], expected[key])
        elif isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(expected):
            for index, (item, expected_item) in enumerate(zip(got, expected)):
                self.tree(f"{where}[{index}]", item, expected_item)
        else:
            self.values += 1
            if not same_value(got, expected):
                self.problems.append(f"{where}: differs")

    def file(self, path: Path, got: Any, expected: Any) -> None:
        self.files.add(str(path))
        self.tree(str(path), got, expected)

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


def verify_pth(plan: ExportPlan, path: Path) -> str:
    check = Comparison()
    check.file(path, read_torch_file(path), {"state_dict": plan.state_dict()})
    return check.summary()


def verify_safetensors(plan: ExportPlan, target: Path) -> str:
    check = Comparison()
    check.files.update(str(file) for file in safetensors_files(target))
    check.tree(str(target), {t.name: t for t in read_safetensors_checkpoint(target)}, plan.state_dict())
    return check.summary()


def verify_diffusers(plan: ExportPlan, target: Path, config: dict) -> str:
    check = Comparison()
    tensors, null = diffusers_export_tensors(plan, config)
    check.files.update(str(file) for file in safetensors_files(target, STEM))
    written = {t.name: t for t in read_safetensors_checkpoint(target, STEM)}
    check.tree(str(target), written, {t.name: t for t in tensors})
    if null:
        path = target / NULL_CAPTION_NAME
        check.file(path, {t.name: t for t in read_safetensors(path)}, {t.name: t for t in null})
    check.file(target / CONFIG_JSON, json.loads((target / CONFIG_JSON).read_text()), config)
    return check.summary()


def verify_accelerate(plan: ExportPlan, folder: Path, pth_path: Path) -> str:
    check = Comparison()
    model_file = folder / MODEL_DIR / MODEL_FILE
    check.file(model_file, read_torch_file(model_file), plan.state_dict())
    check.file(pth_path, read_torch_file(pth_path), {"state_dict": plan.state_dict()})
    if plan.optimizer is not None:
        optimizer_file = folder / MODEL_DIR / OPTIMIZER_FILE
        check.file(optimizer_file, read_torch_file(optimizer_file), plan.optimizer)
    for name, expected in small_files(plan).items():
        # these small files hold RNG states (numpy arrays): written by this tool, read back in full
        check.file(folder / name, torch.load(folder / name, weights_only=False), expected)
    return check.summary()


def verify_dcp(tensors: list[SourceTensor], folder: Path) -> str:
    """A --to-dcp output folder against the single-file input it was made from (`tensors`, as cast for it)."""
    check = Comparison()
    written = DcpCheckpoint(folder)
    check.file(folder, written.nested("model"), {t.name: t for t in tensors})
    check.tree("train_state", written.nested("train_state"), TrainState().state_dict())
    return check.summary()
