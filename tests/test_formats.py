"""sana2/formats: checkpoint files read and written one tensor at a time through public torch and safetensors APIs."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sana2.formats.safetensors_file import read_safetensors_checkpoint, write_safetensors, write_safetensors_folder
from sana2.formats.tensors import CheckpointError, SourceTensor, check_shapes
from sana2.formats.torch_file import read_torch_file, save_torch_file, save_torch_files

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(REPO / "sana2").rglob("*.py"), *(REPO / "tools").glob("*.py")])
# what re-implementing torch.save / torch.load or zip handling looks like
FORBIDDEN = {
    r"torch\._C\b": "private torch C++ bindings",
    r"\bpickle\.(Unpickler|Pickler)\b": "a hand-written (un)pickler",
    r"\b(persistent_id|persistent_load|find_class|reducer_override)\b": "pickle protocol hooks",
    r"\bimport zipfile\b|\bfrom zipfile\b": "zip handling",
    r"\b(write_record|get_record|PyTorchFileReader|PyTorchFileWriter)\b": "torch's zip records",
    r"_rebuild_tensor": "torch.save's pickle internals",
}
# reading the members of Sana's video zips (its SanaZipDataset layout) is what zipfile is for
ZIP_READERS = {"sana2/data/video_sources.py"}


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(REPO)) for p in SOURCES])
def test_no_private_torch_or_hand_written_pickle_or_zip_handling(path):
    text = path.read_text()
    forbidden = dict(FORBIDDEN)
    if str(path.relative_to(REPO)) in ZIP_READERS:
        del forbidden[r"\bimport zipfile\b|\bfrom zipfile\b"]
    found = [f"{why} ({pattern})" for pattern, why in forbidden.items() if re.search(pattern, text)]
    assert not found, f"{path.relative_to(REPO)} uses {', '.join(found)}"


def _sana2_imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return {module for module in modules if module.startswith("sana2")}


def test_layering_formats_below_components_below_tools():
    """formats imports nothing of sana2 but the leaves (staging, log, cli) and the model registry
    (diffusers' format is a translation of the model's names and options); models import nothing
    outside themselves; components never import tools: no cycles."""
    for path in (REPO / "sana2" / "formats").glob("*.py"):
        imported = _sana2_imports(path)
        allowed = {"sana2.staging", "sana2.log", "sana2.cli", "sana2.models.registry", "sana2.models.sana_video"}
        assert imported <= allowed | {m for m in imported if m.startswith("sana2.formats")}, path
    for path in (REPO / "sana2" / "models").glob("*.py"):
        assert all(module.startswith("sana2.models") for module in _sana2_imports(path)), path
    for path in (REPO / "sana2" / "components").glob("*.py"):
        assert not any(module.startswith("sana2.tools") for module in _sana2_imports(path)), path


# -- torch.save files ------------------------------------------------------------------------------
def test_a_streamed_torch_file_loads_bit_exact_with_plain_torch_load(tmp_path):
    tensors = {"a": torch.randn(300, 70), "b": torch.randn(9).to(torch.bfloat16), "c": torch.tensor(3)}
    save_torch_file(tmp_path / "m.pth", {"state_dict": {k: SourceTensor.of(k, v) for k, v in tensors.items()}})
    loaded = torch.load(tmp_path / "m.pth", weights_only=True)["state_dict"]
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_files_sharing_tensors_are_written_together_reading_each_tensor_once(tmp_path):
    reads = []
    weight = torch.randn(5, 3)

    def fill(out, start):
        reads.append(start)
        out.copy_(weight)

    shared = {"w": SourceTensor("w", (5, 3), torch.float32, fill)}
    save_torch_files({tmp_path / "a.bin": shared, tmp_path / "b.pth": {"state_dict": shared}})
    assert len(reads) == 1
    assert torch.equal(torch.load(tmp_path / "a.bin", weights_only=True)["w"], weight)
    assert torch.equal(torch.load(tmp_path / "b.pth", weights_only=True)["state_dict"]["w"], weight)


def test_a_cast_source_is_written_in_its_new_dtype(tmp_path):
    weight = torch.randn(4, 4)
    save_torch_file(tmp_path / "m.pth", {"w": SourceTensor.of("w", weight).to(torch.bfloat16)})
    assert torch.equal(torch.load(tmp_path / "m.pth", weights_only=True)["w"], weight.to(torch.bfloat16))


def test_reading_a_torch_file_gives_rows_without_reading_the_rest(tmp_path):
    weight = torch.arange(40.0).view(10, 4)
    torch.save({"module.w": weight}, tmp_path / "m.pt")
    [source] = read_torch_file(tmp_path / "m.pt").values()
    assert (source.name, source.shape, source.dtype) == ("module.w", (10, 4), torch.float32)
    assert torch.equal(source.read(3, 5), weight[3:5])


MEMORY_SCRIPT = """
import resource, sys, torch
from sana2.formats import torch_file
from sana2.formats.tensors import SourceTensor
torch_file.WINDOW_BYTES = 8 << 20
def fill(out, start):
    out.fill_(1.0)
sources = {str(i): SourceTensor(str(i), (1 << 20,), torch.float32, fill) for i in range(48)}  # 48 x 4 MB
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
torch_file.save_torch_file(sys.argv[1], sources)
written = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for source in torch_file.read_torch_file(sys.argv[1]).values():
    assert source.read().sum().item() == 1 << 20
print((written - before) // 1024, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_writing_and_reading_a_torch_file_keeps_resident_memory_to_a_window_not_the_file(tmp_path):
    """Pages touched through a mapping stay resident while it is mapped: the mapping is redone every window."""
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(tmp_path / "big.pt")], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    grown_writing, grown_reading = map(int, result.stdout.split())
    assert grown_writing < 64 and grown_reading < 64, result.stdout  # MB, for a 192 MB file


def test_a_file_of_other_objects_is_named_without_torchs_weights_only_advice(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(1)}, "args": Path("x")}, tmp_path / "objects.pth")
    with pytest.raises(CheckpointError) as raised:
        read_torch_file(tmp_path / "objects.pth")
    message = str(raised.value)
    assert message.startswith(f"cannot read {tmp_path / 'objects.pth'}: expected a checkpoint of tensors")
    assert "pathlib" in message and "weights_only" not in message and "\n" not in message


# -- safetensors ---------------------------------------------------------------------------------
def test_a_streamed_safetensors_file_reads_back_with_safe_open(tmp_path):
    tensors = {"b": torch.randn(3, 5).bfloat16(), "a": torch.arange(7), "s": torch.tensor(2.5), "e": torch.zeros(0, 3)}
    write_safetensors(tmp_path / "m.safetensors", [SourceTensor.of(k, v) for k, v in tensors.items()], {"step": "3"})
    with safe_open(tmp_path / "m.safetensors", "pt") as file:
        assert file.metadata() == {"step": "3"} and list(file.offset_keys()) == list(tensors)
        for name, tensor in tensors.items():
            got = file.get_tensor(name)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_a_sharded_safetensors_folder_has_an_index_matching_its_shards(tmp_path):
    tensors = [SourceTensor.of(f"w{i}", torch.full((100,), float(i))) for i in range(5)]
    paths = write_safetensors_folder(tmp_path, tensors, {}, max_shard_bytes=800, stem="diffusion_pytorch_model")
    assert [p.name for p in paths] == [f"diffusion_pytorch_model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000 and index["weight_map"]["w4"] == paths[2].name
    read = {t.name: t for t in read_safetensors_checkpoint(tmp_path)}
    assert list(read) == [f"w{i}" for i in range(5)]
    assert torch.equal(read["w3"].read(10, 20), torch.full((10,), 3.0))


def test_safetensors_rows_are_read_from_a_file_written_by_the_library(tmp_path):
    weight = torch.randn(8, 3)
    save_file({"w": weight}, tmp_path / "m.safetensors")
    [source] = read_safetensors_checkpoint(tmp_path / "m.safetensors")
    assert torch.equal(source.read(2, 6), weight[2:6])


# -- the one mismatch report -------------------------------------------------------------------
def test_check_shapes_names_every_missing_unexpected_and_misshaped_key():
    with pytest.raises(CheckpointError) as raised:
        check_shapes("x.pth", {"a": (2,), "b": (3,), "extra": (1,)}, {"a": (2,), "b": (4,), "c": (5,)})
    assert str(raised.value) == (
        "x.pth does not match this run (another model or options?): c is missing; "
        "b has shape (3,), this run needs (4,); extra is stored but this model has no such tensor"
    )
    check_shapes("x.pth", {"a": (2,), "ignored": (1,)}, {"a": (2,)}, unexpected=lambda key: key != "ignored")
