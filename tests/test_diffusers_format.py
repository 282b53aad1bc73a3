"""sana2 <-> diffusers Sana transformers (sana2/formats/diffusers.py): names, configs, numbers.

Tiny image and video models are built from configs (nothing is downloaded); the diffusers model
is built from the translated config and loaded strictly from the mapped tensors.
"""

import json

import pytest
import torch
from diffusers import SanaTransformer2DModel, SanaVideoTransformer3DModel
from safetensors.torch import save_file

from sana2.cli import CONFIG_JSON
from sana2.distributed.initialize import init_weights
from sana2.formats.diffusers import (
    IMAGE_CLASS,
    INDEX_NAME,
    NOT_IN_DIFFUSERS,
    VIDEO_CLASS,
    WEIGHTS_NAME,
    DiffusersFormatError,
    Piece,
    check_diffusers_names,
    diffusers_config,
    export_pieces,
    import_sources,
    join,
    sana2_model,
    source_rows,
)
from sana2.formats.diffusers_folder import STEM
from sana2.formats.safetensors_file import shard_name
from sana2.models import build_model

TINY_VIDEO = dict(
    depth=2,
    hidden_size=64,
    num_heads=2,
    linear_head_dim=32,
    in_channels=4,
    caption_channels=32,
    model_max_length=16,
    input_size=8,
)
SANA_CROSS_NORM_EPS = 1e-6  # Sana's (and sana2's) cross-attention q/k RMSNorm eps; diffusers fixes 1e-5


def diffusers_class(config: dict):
    return {IMAGE_CLASS: SanaTransformer2DModel, VIDEO_CLASS: SanaVideoTransformer3DModel}[config["_class_name"]]


def build_pair(name: str, overrides: dict):
    """A randomly initialised sana2 model and the diffusers model loaded (strictly) from its export."""
    model = build_model(name, **overrides).eval()
    init_weights(model, seed=3)
    config = diffusers_config(name, overrides)
    video = config["_class_name"] == VIDEO_CLASS
    exported = {}
    for key, tensor in model.state_dict().items():
        for piece in export_pieces(key, video):
            assert piece.shape(tuple(tensor.shape)) == tuple(piece.take(tensor).shape)
            exported[piece.name] = piece.take(tensor).clone()
    reference = diffusers_class(config).from_config(config).eval()
    reference.load_state_dict(exported, strict=True)
    return model, reference, config, exported


def inputs(model, config: dict, spatial: tuple[int, ...]):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.in_channels, *spatial, generator=generator)
    y = torch.randn(2, 1, 16, config["caption_channels"], generator=generator)
    mask = torch.ones(2, 16)
    mask[0, 10:] = 0  # padded caption tokens in the first sample
    # integer timesteps: Sana's model (and sana2's) truncates fractional ones, diffusers' does not
    timestep = torch.tensor([17.0, 900.0])
    return x, timestep, y, mask


def max_difference(model, reference, config, spatial) -> float:
    x, timestep, y, mask = inputs(model, config, spatial)
    with torch.no_grad():
        ours = model(x, timestep, y, mask)
        theirs = reference(
            x, y.squeeze(1), timestep * config.get("timestep_scale", 1.0), encoder_attention_mask=mask
        ).sample
    assert ours.shape == theirs.shape
    return (ours - theirs).abs().max().item()


@pytest.mark.parametrize(
    "overrides, spatial",
    [
        ({}, (8, 8)),
        (dict(use_pe=True, pe_interpolation=0.5, patch_size=2, pred_sigma=True), (8, 12)),
        (dict(timestep_norm_scale_factor=1000.0, mlp_ratio=3.0), (8, 8)),
    ],
    ids=["debug", "pe-patch2-sigma-nonsquare", "timestep-scale"],
)
def test_diffusers_image_model_from_export_matches_sana2_output(overrides, spatial):
    model, reference, config, _ = build_pair("SanaMS_debug", overrides)
    assert config["_class_name"] == IMAGE_CLASS
    assert max_difference(model, reference, config, spatial) < 1e-5


def test_diffusers_video_model_from_export_matches_sana2_output():
    overrides = dict(TINY_VIDEO, qk_norm=False, cross_norm=False)
    model, reference, config, _ = build_pair("SanaMSVideo", overrides)
    assert config["_class_name"] == VIDEO_CLASS
    assert max_difference(model, reference, config, (3, 8, 8)) < 1e-5


@pytest.mark.parametrize(
    "name, overrides, spatial",
    [
        ("SanaMS_debug", dict(qk_norm=True, cross_norm=True), (8, 8)),
        ("SanaMSVideo", TINY_VIDEO, (3, 8, 8)),  # the video model's defaults have qk_norm and cross_norm on
    ],
    ids=["image", "video"],
)
def test_qk_norm_export_differs_only_by_diffusers_cross_attention_eps(name, overrides, spatial):
    """diffusers builds the cross-attention q/k RMSNorm with eps 1e-5, Sana with 1e-6 (diffusers' own
    Sana 1.5 / Sana-Video conversions have the same difference). With Sana's eps put into diffusers'
    model the outputs agree, so the mapping itself is exact; with diffusers' eps they stay close."""
    model, reference, config, _ = build_pair(name, overrides)
    assert config["qk_norm"] == "rms_norm_across_heads"
    with_diffusers_eps = max_difference(model, reference, config, spatial)
    for block in reference.transformer_blocks:
        block.attn2.norm_q.eps = block.attn2.norm_k.eps = SANA_CROSS_NORM_EPS
    assert max_difference(model, reference, config, spatial) < 1e-5
    assert with_diffusers_eps < 1e-2


@pytest.mark.parametrize("shards", [1, 2])
def test_exported_folder_loads_with_from_pretrained(tmp_path, monkeypatch, shards):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _, config, exported = build_pair("SanaMS_debug", dict(use_pe=True))
    (tmp_path / CONFIG_JSON).write_text(json.dumps(config))
    if shards == 1:
        save_file(exported, tmp_path / WEIGHTS_NAME, metadata={"format": "pt"})
    else:
        names = list(exported)
        parts = [names[: len(names) // 2], names[len(names) // 2 :]]
        weight_map = {}
        for index, part in enumerate(parts):
            file = shard_name(index, len(parts), STEM)
            save_file({n: exported[n] for n in part}, tmp_path / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        total = sum(t.numel() * t.element_size() for t in exported.values())
        (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    loaded = SanaTransformer2DModel.from_pretrained(tmp_path).eval()
    assert max_difference(model, loaded, config, (8, 8)) < 1e-5


def test_source_rows_read_a_row_range_of_a_joined_tensor():
    pieces = [torch.arange(i * 12, (i + 1) * 12).reshape(4, 3) for i in range(3)]  # qkv: three 4-row pieces
    whole = join(pieces)
    names = ["to_q", "to_k", "to_v"]
    for start, end in [(0, 12), (3, 9), (4, 8), (11, 12), (5, 5)]:
        ranges = source_rows(names, 12, start, end)
        rows = [pieces[names.index(n)][a:b] for n, a, b in ranges]
        assert torch.equal(torch.cat(rows) if rows else whole[0:0], whole[start:end])
    assert source_rows(names, 12, 3, 9) == [("to_q", 3, 4), ("to_k", 0, 4), ("to_v", 0, 1)]


def random_diffusers_model(config: dict):
    torch.manual_seed(5)
    reference = diffusers_class(config).from_config(config)
    with torch.no_grad():
        for parameter in reference.parameters():  # norms start at 1: make every tensor distinct
            parameter.normal_()
    return reference


@pytest.mark.parametrize(
    "name, overrides",
    [
        (
            "SanaMS_debug",
            dict(qk_norm=True, cross_norm=True, use_pe=True, patch_size=2, timestep_norm_scale_factor=1000.0),
        ),
        ("SanaMSVideo", TINY_VIDEO),
    ],
    ids=["image", "video"],
)
def test_import_then_export_round_trips_bit_exact(name, overrides):
    config = diffusers_config(name, overrides)
    video = config["_class_name"] == VIDEO_CLASS
    original = random_diffusers_model(config).state_dict()

    # import: the sana2 model the config describes, each tensor joined from its diffusers pieces
    imported_name, kwargs = sana2_model(config)
    with torch.device("meta"):
        target = build_model(imported_name, model_max_length=16, **kwargs)
    shapes = {key: tuple(t.shape) for key, t in target.state_dict().items()}
    sources = import_sources(shapes, video)
    check_diffusers_names({n for names in sources.values() for n in names}, set(original), "diffusers model")
    assert set(shapes) - set(sources) == set(NOT_IN_DIFFUSERS)
    imported = {key: join([original[n] for n in names]) for key, names in sources.items()}
    assert all(tuple(imported[key].shape) == shapes[key] for key in imported)

    # export again: every diffusers tensor comes back bit for bit
    exported = {piece.name: piece.take(t) for key, t in imported.items() for piece in export_pieces(key, video)}
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    assert diffusers_config(imported_name, dict(model_max_length=16, **kwargs)) == config


def test_export_then_import_round_trips_every_sana2_tensor_diffusers_holds():
    model = build_model("SanaMSVideo", **TINY_VIDEO)
    init_weights(model, seed=1)
    state = model.state_dict()
    exported = {piece.name: piece.take(t) for key, t in state.items() for piece in export_pieces(key, True)}
    sources = import_sources(state, True)
    for key, names in sources.items():
        assert torch.equal(join([exported[n] for n in names]), state[key])
    assert set(state) - set(sources) == set(NOT_IN_DIFFUSERS)


def test_config_translation_carries_every_option_back():
    overrides = dict(
        qk_norm=True, cross_norm=True, use_pe=True, pe_interpolation=2.0, patch_size=2, pred_sigma=True, mlp_ratio=3.0
    )
    name, kwargs = sana2_model(diffusers_config("SanaMS_debug", overrides))
    assert name == "SanaMS"
    rebuilt = build_model(name, model_max_length=16, **kwargs)
    original = build_model("SanaMS_debug", **overrides)
    assert {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()} == {
        k: tuple(v.shape) for k, v in original.state_dict().items()
    }
    assert kwargs["pe_interpolation"] == 2.0 and kwargs["pred_sigma"] and kwargs["qk_norm"] and kwargs["use_pe"]


@pytest.mark.parametrize(
    "name, overrides, option",
    [
        ("SanaMS_debug", dict(attn_type="flash"), "attn_type"),
        ("SanaMS_debug", dict(y_norm=False), "y_norm"),
        ("SanaMS_debug", dict(qk_norm=True), "qk_norm"),
        ("SanaMS_debug", dict(patch_size=(1, 2)), "patch_size"),
        ("SanaMSVideo", dict(TINY_VIDEO, t_kernel_size=5), "t_kernel_size"),
        ("SanaMSVideo", dict(TINY_VIDEO, ffn_type="glumbconv"), "ffn_type"),
        ("SanaMSVideo", dict(TINY_VIDEO, attn_type="linear"), "attn_type"),
        ("SanaMSVideo", dict(TINY_VIDEO, timestep_norm_scale_factor=1000.0), "timestep_norm_scale_factor"),
    ],
)
def test_option_diffusers_cannot_express_raises_error_naming_it(name, overrides, option):
    with pytest.raises(DiffusersFormatError, match=rf"model option {option}="):
        diffusers_config(name, overrides)


def test_foreign_diffusers_config_is_refused_by_name():
    config = diffusers_config("SanaMS_debug")
    with pytest.raises(DiffusersFormatError, match="guidance_embeds"):
        sana2_model({**config, "guidance_embeds": True})
    with pytest.raises(DiffusersFormatError, match="_class_name 'PixArtTransformer2DModel'"):
        sana2_model({**config, "_class_name": "PixArtTransformer2DModel"})


def test_name_errors_say_which_tensors():
    with pytest.raises(DiffusersFormatError, match="blocks.0.attn.extra.weight"):
        export_pieces("blocks.0.attn.extra.weight", video=False)
    with pytest.raises(DiffusersFormatError, match="missing proj_out.bias; unexpected proj_out.extra"):
        check_diffusers_names({"proj_out.weight", "proj_out.bias"}, {"proj_out.weight", "proj_out.extra"}, "folder x")
    with pytest.raises(DiffusersFormatError, match="does not split into 3"):
        Piece("attn1.to_q.weight", 0, 3).shape((64, 64))
