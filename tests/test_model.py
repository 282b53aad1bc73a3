"""The Sana DiT: key-exact against the manifests, number-exact against the parity fixtures."""

import json
from pathlib import Path

import pytest
import torch

from sana2.distributed.initialize import init_weights
from sana2.models import ModelConfigError, build_model

DATA = Path(__file__).parent / "data"
MANIFESTS = sorted(DATA.glob("manifest_*.json"))
FIXTURES = sorted(DATA.glob("parity_*.pt"))


def test_data_is_present():
    assert len(MANIFESTS) == 5 and len(FIXTURES) == 2


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_meta_model_matches_manifest_keys_shapes_and_counts(path):
    manifest = json.loads(path.read_text())
    with torch.device("meta"):
        model = build_model(manifest["model"], **manifest["constructor_kwargs"])
    got = [(k, list(v.shape)) for k, v in model.state_dict().items()]
    assert got == [(k, shape) for k, shape, _ in manifest["state_dict"]]
    assert sum(p.numel() for p in model.parameters()) == manifest["num_params"]
    assert sum(v.numel() for v in model.state_dict().values()) == manifest["num_state_dict_elements"]
    buffers = [name for name, _ in model.named_buffers()]
    assert buffers == manifest["persistent_buffers"]
    assert all(p.is_meta for p in model.parameters())


def _load_fixture(path):
    fixture = torch.load(path, weights_only=False)
    model = build_model(fixture["model_class"], **fixture["constructor_kwargs"])
    model.load_state_dict(fixture["state_dict"], strict=True)
    return fixture, model.eval()


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_parity_fixture_output_and_intermediates(path):
    fixture, model = _load_fixture(path)
    captured = {}
    for name in fixture["intermediates"]:
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: captured.__setitem__(name, out)
        )
    inputs = fixture["inputs"]
    with torch.no_grad():
        out = model(inputs["x"], inputs["timestep"], inputs["y"], mask=inputs["mask"])
    for name, expected in fixture["intermediates"].items():
        torch.testing.assert_close(captured[name], expected, atol=5e-6, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(out, fixture["output"], atol=5e-6, rtol=0)


def test_guidance_batch_tiles_the_mask():
    fixture, model = _load_fixture(FIXTURES[0])
    inputs = fixture["inputs"]
    x2 = torch.cat([inputs["x"]] * 2)
    t2 = torch.cat([inputs["timestep"]] * 2)
    y2 = torch.cat([inputs["y"]] * 2)
    with torch.no_grad():
        tiled = model(x2, t2, y2, mask=inputs["mask"])
        explicit = model(x2, t2, y2, mask=torch.cat([inputs["mask"]] * 2))
    torch.testing.assert_close(tiled, explicit, atol=0, rtol=0)
    torch.testing.assert_close(tiled[:2], fixture["output"], atol=5e-6, rtol=0)


def test_padded_caption_tokens_do_not_change_the_output_but_the_mask_does():
    fixture, model = _load_fixture(FIXTURES[0])
    inputs = fixture["inputs"]
    mask = inputs["mask"]
    y = inputs["y"].clone()
    y[1, :, 3:] = torch.randn_like(y[1, :, 3:]) * 10  # sample 1 pads tokens 3 and 4
    with torch.no_grad():
        out = model(inputs["x"], inputs["timestep"], y, mask=mask)
        other_mask = mask.clone()
        other_mask[0, ..., -1] = 0
        masked = model(inputs["x"], inputs["timestep"], inputs["y"], mask=other_mask.view(2, -1))
    torch.testing.assert_close(out, fixture["output"], atol=5e-6, rtol=0)
    assert (masked[0] - fixture["output"][0]).abs().max() > 1e-4
    torch.testing.assert_close(masked[1], fixture["output"][1], atol=5e-6, rtol=0)


def test_timestep_is_truncated_with_scale_factor_one():
    fixture, model = _load_fixture(FIXTURES[0])
    inputs = fixture["inputs"]
    with torch.no_grad():
        floored = model(inputs["x"], inputs["timestep"].floor().long(), inputs["y"], mask=inputs["mask"])
    torch.testing.assert_close(floored, fixture["output"], atol=5e-6, rtol=0)


def test_saved_state_dict_reloads_strictly_and_pos_embed_is_ignorable():
    torch.manual_seed(0)
    model = build_model("SanaMS_debug", use_pe=True)
    init_weights(model, seed=3)
    state = model.state_dict()
    assert "pos_embed" in state and "y_embedder.y_embedding" in state
    fresh = build_model("SanaMS_debug", use_pe=True)
    fresh.load_state_dict(state, strict=True)
    for key, value in state.items():
        torch.testing.assert_close(fresh.state_dict()[key], value, atol=0, rtol=0)
    # the reference's loader deletes pos_embed and loads non-strictly: only pos_embed is missing
    without = {k: v for k, v in state.items() if k != "pos_embed"}
    result = build_model("SanaMS_debug", use_pe=True).load_state_dict(without, strict=False)
    assert result.missing_keys == ["pos_embed"] and result.unexpected_keys == []


def test_meta_construction_allocates_nothing_and_init_is_deterministic():
    with torch.device("meta"):
        model = build_model("SanaMS_debug")
    assert all(t.is_meta for t in model.state_dict().values())
    model.to_empty(device="cpu")
    init_weights(model, seed=7)
    other = build_model("SanaMS_debug")
    init_weights(other, seed=7)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    third = build_model("SanaMS_debug")
    init_weights(third, seed=8)
    assert not torch.equal(third.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)


def test_init_follows_the_reference_scheme():
    model = build_model("SanaMS_debug", y_norm_scale_factor=0.01, qk_norm=True, cross_norm=True)
    init_weights(model, seed=0)
    d = model.hidden_size
    assert torch.all(model.attention_y_norm.weight == 0.01)
    assert torch.all(model.blocks[0].attn.q_norm.weight == 1)
    assert torch.all(model.blocks[0].cross_attn.proj.bias == 0)
    assert abs(model.t_block[1].weight.std().item() - 0.02) < 0.002
    qkv = model.blocks[0].attn.qkv.weight
    bound = (6 / (qkv.shape[0] + qkv.shape[1])) ** 0.5
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.9 * bound  # xavier uniform
    table = model.blocks[0].scale_shift_table
    assert abs(table.std().item() * d**0.5 - 1) < 0.15
    assert model.final_layer.linear.weight.abs().max() > 0  # not adaLN-zero


def test_bf16_forward_stays_close_to_fp32():
    torch.manual_seed(0)
    model = build_model("SanaMS_debug").eval()
    init_weights(model, seed=1)
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([10, 900])
    y = torch.randn(2, 1, 16, 32)
    mask = torch.ones(2, 16)
    mask[1, 9:] = 0
    with torch.no_grad():
        ref = model(x, t, y, mask)
        out = model.to(torch.bfloat16)(x, t, y, mask)
    assert out.dtype == torch.bfloat16
    # bf16 has an 8-bit mantissa (~4e-3 relative); two blocks keep the error within 5% of the output scale
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_caption_dropout_replaces_captions_with_the_null_embedding():
    model = build_model("SanaMS_debug")
    init_weights(model, seed=0)
    model.train()
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([100, 200])
    y = torch.randn(2, 1, 16, 32)
    null = model.y_embedder.y_embedding[None, None].expand(2, 1, 16, 32)
    dropped = model(x, t, y, None, drop_ids=torch.tensor([True, False]))
    explicit = model(x, t, torch.stack([null[0], y[1]]), None, drop_ids=torch.tensor([False, False]))
    torch.testing.assert_close(dropped, explicit, atol=0, rtol=0)


def test_video_model_forward_shapes_and_rope():
    from sana2.models.layers import apply_rope, rope_angles, rope_axis_dims

    assert rope_axis_dims(112) == (40, 36, 36)
    angles = rope_angles(112, (2, 3, 4))
    assert angles.shape == (24, 56)
    assert torch.all(angles[0] == 0)  # position (0, 0, 0) is not rotated
    q = torch.randn(1, 1, 24, 112)
    assert torch.allclose(apply_rope(q, angles).norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # rotation
    model = build_model(
        "SanaMSVideo",
        hidden_size=64,
        depth=2,
        num_heads=2,
        linear_head_dim=32,
        caption_channels=16,
        model_max_length=5,
        input_size=8,
    )
    init_weights(model, seed=0)
    model.eval()
    x = torch.randn(1, 16, 3, 8, 8)
    with torch.no_grad():
        out = model(x, torch.tensor([500]), torch.randn(1, 1, 5, 16))
    assert out.shape == x.shape
    assert torch.all(model.blocks[0].mlp.t_conv.weight == 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"not_a_keyword": 1}, "not_a_keyword"),
        ({"attn_type": "mamba"}, "attn_type"),
        ({"mlp_acts": ["gelu", "gelu", None]}, "mlp_acts"),
        ({"hidden_size": 65}, "hidden_size"),
        ({"use_pe": "False"}, "use_pe='False' for SanaMS_debug: expected true or false"),
        ({"depth": 2.5}, "depth=2.5 for SanaMS_debug: expected an integer"),
        ({"mlp_ratio": "2.5"}, "mlp_ratio='2.5' for SanaMS_debug: expected a number"),
        ({"patch_size": [1, "2"]}, "patch_size"),
    ],
)
def test_invalid_keywords_are_errors_naming_them(kwargs, field):
    with pytest.raises(ModelConfigError, match=field):
        build_model("SanaMS_debug", **kwargs)


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ModelConfigError, match="SanaMS_600M_P1_D28"):
        build_model("SanaMS_9000M")


def test_softmax_self_attention_with_qk_norm_is_scaled_dot_product_attention():
    """attn_type "flash": affine-LayerNorm qk_norm on full-width q and k, then per-head softmax."""
    model = build_model("SanaMS_debug", attn_type="flash", qk_norm=True)
    init_weights(model, seed=0)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.bias.uniform_(-0.1, 0.1)
        x = torch.randn(2, 12, model.hidden_size)
        q, k, v = attn.qkv(x).chunk(3, dim=-1)
        q, k = attn.q_norm(q), attn.k_norm(k)
        heads, d = model.num_heads, model.hidden_size // model.num_heads
        q, k, v = (t.view(2, 12, heads, d).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / d**0.5, dim=-1)
        expected = attn.proj((weights @ v).transpose(1, 2).reshape(2, 12, -1))
        torch.testing.assert_close(attn(x), expected, atol=1e-6, rtol=0)
        out = model(torch.randn(1, 4, 8, 8), torch.tensor([10]), torch.randn(1, 1, 16, 32))
    assert out.shape == (1, 4, 8, 8) and torch.isfinite(out).all()
    assert "blocks.0.attn.qkv.bias" in model.state_dict() and "blocks.0.attn.q_norm.bias" in model.state_dict()


def test_the_model_describes_the_data_it_takes():
    model = build_model("SanaMS_debug")  # 4 channels, 16 caption tokens of width 32, patch 1
    assert model.caption_shape == (16, 32)
    init_weights(model, seed=0)
    assert model.null_caption().shape == (16, 32) and model.null_caption().abs().sum() > 0
    assert model.num_tokens((4, 8, 6)) == 48
    model.check_fits((4, 8, 6), (16, 32))
    with pytest.raises(ValueError) as error:
        model.check_fits((3, 8, 8), (12, 64))
    for problem in (
        "in_channels=4 but the data's latents have 3 channels",
        "caption_channels=32 but the data's caption embeddings have 64",
        "model_max_length=16 but the data's captions have 12 tokens",
    ):
        assert problem in str(error.value)
    with pytest.raises(ValueError, match=r"latent size \(9, 8\) is not divisible by the patch size \(2, 2\)"):
        build_model("SanaMS_debug", patch_size=2).check_fits((4, 9, 8), (16, 32))
    with pytest.raises(ValueError, match="takes 2-D latents, the data's are 3-D"):
        model.check_fits((4, 2, 8, 8), (16, 32))
    video = build_model("SanaMSVideo", hidden_size=64, depth=1, num_heads=2, linear_head_dim=32, in_channels=4)
    assert video.num_tokens((4, 3, 8, 8)) == 3 * 4 * 4  # patch (1, 2, 2)


def test_models_know_nothing_of_parallelism():
    sources = sorted((Path(__file__).resolve().parents[1] / "sana2" / "models").glob("*.py"))
    assert sources
    for source in sources:
        text = source.read_text()
        assert "torch.distributed" not in text and "DTensor" not in text, source.name
