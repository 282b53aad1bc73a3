"""diffusers model folders through sana2-convert: `--format diffusers` writes what diffusers'
`from_pretrained` loads (image and video, one file or shards), and `--to-dcp` reads diffusers'
own folders back bit for bit. Tiny models from configs; nothing is downloaded."""

import json

import pytest
import torch
from checkpoint_factory import save_single_process_run
from diffusers import SanaTransformer2DModel, SanaVideoTransformer3DModel
from safetensors.torch import load_file, save_file

from sana2.cli import CONFIG_JSON
from sana2.components.initial_load import load_initial_weights
from sana2.config import load_config
from sana2.distributed.initialize import init_weights
from sana2.formats.dcp_folder import DcpCheckpoint
from sana2.formats.diffusers import INDEX_NAME, WEIGHTS_NAME, diffusers_config, import_sources, join
from sana2.formats.diffusers_folder import NULL_CAPTION_KEY, NULL_CAPTION_NAME, read_diffusers_folder
from sana2.models import build_model
from sana2.tools.convert_checkpoint import main

IMAGE = ("SanaMS_debug", {"use_pe": True})
VIDEO = (
    "SanaMSVideo",
    dict(depth=2, hidden_size=64, num_heads=2, linear_head_dim=32, in_channels=4, caption_channels=32,
         model_max_length=16, input_size=8, qk_norm=False, cross_norm=False),
)  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def convert(*args) -> int:
    return main([str(arg) for arg in args])


def run_config(name: str, overrides: dict):
    options = [f"--model.name={name}", *(f"--model.{k}={json.dumps(v)}" for k, v in overrides.items())]
    return load_config(None, options)


def trained_checkpoint(tmp_path, name: str, overrides: dict) -> tuple:
    """A sana2 step folder of a model trained 2 steps in one process, and the model's state."""
    folder = tmp_path / "run" / "step-2"
    saved = save_single_process_run(folder, run_config(name, overrides), steps=2)
    return folder, saved["full"]["model"]


def outputs(model, x, y, timestep, sana2: bool) -> torch.Tensor:
    mask = torch.ones(x.shape[0], y.shape[-2])
    mask[0, 10:] = 0
    with torch.no_grad():
        if sana2:
            return model.eval()(x, timestep, y, mask)
        return model.eval()(x, y.squeeze(1), timestep, encoder_attention_mask=mask).sample


@pytest.mark.parametrize("shards", [1, 4])
def test_image_export_loads_with_from_pretrained_and_matches_sana2(tmp_path, shards):
    source, state = trained_checkpoint(tmp_path, *IMAGE)
    out = tmp_path / "diffusers"
    flags = ["--max-shard-size", "250KB"] if shards > 1 else []
    assert convert(source, out, "--format", "diffusers", "--verify", *flags) == 0
    weight_files = sorted(p.name for p in out.glob("diffusion_pytorch_model*.safetensors"))
    assert len(weight_files) == shards and (out / INDEX_NAME).is_file() == (shards > 1)
    assert load_file(out / NULL_CAPTION_NAME)[NULL_CAPTION_KEY].equal(state[NULL_CAPTION_KEY])

    loaded = SanaTransformer2DModel.from_pretrained(out)
    model = build_model(IMAGE[0], **IMAGE[1])
    model.load_state_dict(state)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 4, 8, 12, generator=generator), torch.randn(2, 1, 16, 32, generator=generator)
    timestep = torch.tensor([17.0, 900.0])
    difference = (outputs(model, x, y, timestep, True) - outputs(loaded, x, y, timestep, False)).abs().max()
    assert difference < 1e-5


def test_video_export_loads_with_from_pretrained_and_matches_sana2(tmp_path):
    source, state = trained_checkpoint(tmp_path, *VIDEO)
    assert convert(source, tmp_path / "diffusers", "--format", "diffusers") == 0
    config = json.loads((tmp_path / "diffusers" / CONFIG_JSON).read_text())
    assert config["_class_name"] == "SanaVideoTransformer3DModel"
    loaded = SanaVideoTransformer3DModel.from_pretrained(tmp_path / "diffusers")
    model = build_model(VIDEO[0], **VIDEO[1])
    model.load_state_dict(state)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 4, 3, 8, 8, generator=generator), torch.randn(2, 1, 16, 32, generator=generator)
    timestep = torch.tensor([17.0, 900.0])
    difference = (outputs(model, x, y, timestep, True) - outputs(loaded, x, y, timestep, False)).abs().max()
    assert difference < 1e-5


def test_qk_norm_export_says_diffusers_cross_attention_eps_differs(tmp_path, capsys):
    source, _ = trained_checkpoint(tmp_path, "SanaMS_debug", {"qk_norm": True, "cross_norm": True})
    assert convert(source, tmp_path / "diffusers", "--format", "diffusers") == 0
    assert "eps 1e-5 where Sana uses 1e-6" in capsys.readouterr().out
    assert SanaTransformer2DModel.from_pretrained(tmp_path / "diffusers").config.qk_norm == "rms_norm_across_heads"


def test_a_model_diffusers_cannot_express_is_refused_naming_the_option(tmp_path, capsys):
    source, _ = trained_checkpoint(tmp_path, "SanaMS_debug", {"attn_type": "flash"})
    assert convert(source, tmp_path / "diffusers", "--format", "diffusers") == 2
    error = capsys.readouterr().err
    assert "model option attn_type='flash' cannot be expressed in diffusers" in error
    assert not (tmp_path / "diffusers").exists()


def diffusers_saved_folder(tmp_path, name: str, overrides: dict):
    """A randomly initialised diffusers model written by diffusers' own save_pretrained, and its state."""
    config = diffusers_config(name, overrides)
    kind = SanaVideoTransformer3DModel if config["_class_name"].startswith("SanaVideo") else SanaTransformer2DModel
    torch.manual_seed(5)
    model = kind.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():  # norms start at 1: make every tensor distinct
            parameter.normal_()
    folder = tmp_path / "from_diffusers"
    model.save_pretrained(folder, max_shard_size="200KB")
    return folder, model.state_dict()


@pytest.mark.parametrize("name, overrides", [IMAGE, VIDEO], ids=["image", "video"])
def test_diffusers_folder_imports_to_dcp_and_exports_back_bit_exact(tmp_path, name, overrides):
    folder, original = diffusers_saved_folder(tmp_path, name, overrides)
    assert (folder / INDEX_NAME).is_file()  # diffusers wrote shards: each sana2 tensor is read across them
    assert convert("--to-dcp", folder, tmp_path / "step-0", "--verify") == 0

    imported = DcpCheckpoint(tmp_path / "step-0").nested("model", read_tensors=True)
    video = name == "SanaMSVideo"
    sources = import_sources(imported, video)
    assert set(imported) - set(sources) == {"pos_embed"}  # computed; the null caption is not in the folder
    for key, names in sources.items():
        assert torch.equal(imported[key], join([original[n] for n in names])), key
    with torch.device("meta"):
        reference = build_model(name, **overrides)
    assert torch.equal(imported["pos_embed"], reference.initial_pos_embed())

    # the DCP folder names the model, so it exports again: every diffusers tensor comes back bit for bit
    assert convert(tmp_path / "step-0", tmp_path / "again", "--format", "diffusers", "--verify") == 0
    files = (tmp_path / "again").glob("diffusion_pytorch_model*.safetensors")
    exported = {k: v for file in files for k, v in load_file(file).items()}
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    assert not (tmp_path / "again" / NULL_CAPTION_NAME).exists()


def test_sana2_export_and_import_round_trips_the_whole_checkpoint(tmp_path):
    source, state = trained_checkpoint(tmp_path, *IMAGE)
    assert convert(source, tmp_path / "diffusers", "--format", "diffusers", "--max-shard-size", "100KB") == 0
    tensors = read_diffusers_folder(tmp_path / "diffusers")
    assert [t.name for t in tensors] == list(state)  # the model's order, null caption and pos_embed included
    for tensor in tensors:
        assert torch.equal(tensor.read(), state[tensor.name]), tensor.name
        if tensor.shape[0] >= 7:  # a range of rows that crosses qkv's and kv's pieces, read on its own
            rows = tensor.shape[0] // 3
            assert torch.equal(tensor.read(rows - 2, 2 * rows + 1), state[tensor.name][rows - 2 : 2 * rows + 1])


def test_foreign_or_damaged_diffusers_folders_fail_naming_the_problem(tmp_path, capsys):
    folder, _ = diffusers_saved_folder(tmp_path, *IMAGE)
    config = json.loads((folder / CONFIG_JSON).read_text())
    (folder / CONFIG_JSON).write_text(json.dumps({**config, "guidance_embeds": True}))
    assert convert("--to-dcp", folder, tmp_path / "a") == 2
    assert "guidance_embeds=True" in capsys.readouterr().err
    (folder / CONFIG_JSON).write_text(json.dumps({**config, "num_layers": 3}))
    assert convert("--to-dcp", folder, tmp_path / "b") == 2
    assert "missing transformer_blocks.2." in capsys.readouterr().err
    (folder / CONFIG_JSON).write_text(json.dumps(config))
    for shard in folder.glob("diffusion_pytorch_model-*.safetensors"):
        shard.unlink()
    assert convert("--to-dcp", folder, tmp_path / "c") == 2
    assert "diffusion_pytorch_model-00001-of" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


def test_initial_load_of_a_single_file_folder_keeps_the_models_null_caption(tmp_path):
    folder, original = diffusers_saved_folder(tmp_path, *IMAGE)
    for path in list(folder.glob("diffusion_pytorch_model*")):
        path.unlink()
    save_file({k: v.contiguous() for k, v in original.items()}, folder / WEIGHTS_NAME)  # as released: one file
    model = build_model(IMAGE[0], **IMAGE[1])
    init_weights(model, 0)
    null_caption = model.null_caption().clone()
    assert load_initial_weights(model, folder) == [NULL_CAPTION_KEY]
    assert torch.equal(model.null_caption(), null_caption)
    loaded = model.state_dict()["blocks.1.attn.qkv.weight"]
    assert torch.equal(loaded[64:128], original["transformer_blocks.1.attn1.to_k.weight"])
