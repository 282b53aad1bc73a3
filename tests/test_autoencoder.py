"""The autoencoder interface: diffusers VAEs from local folders, images and videos, each with its own
latent normalisation and compression factors (the Wan VAE: tests/test_wan_vae.py)."""

import json

import pytest
import torch
from encoder_factory import TINY_DC_AE, save_tiny_dc_ae, save_tiny_kl

from sana2.encoders.autoencoder import DC_AE_F32C32_CONFIG, build_autoencoder


@pytest.fixture(scope="module")
def dc_ae_dir(tmp_path_factory):
    return save_tiny_dc_ae(tmp_path_factory.mktemp("dcae"))


@pytest.fixture(scope="module")
def kl_dir(tmp_path_factory):
    return save_tiny_kl(tmp_path_factory.mktemp("kl"))


def pixels(batch=2, height=16, width=24):
    return torch.rand(batch, 3, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_dc_ae_latents_are_scaled_by_its_scaling_factor(dc_ae_dir):
    from diffusers import AutoencoderDC

    vae = build_autoencoder(dc_ae_dir)
    scale, shift = vae.normalization.scale, vae.normalization.shift
    assert (float(scale), float(shift), vae.latent_channels, vae.spatial_compression) == (0.5, 0.0, 4, 2)
    assert vae.temporal_compression == 1 and vae.latent_shape(16, 24) == (4, 8, 12)
    x = pixels()
    raw = AutoencoderDC.from_pretrained(dc_ae_dir).eval()
    with torch.no_grad():
        expected = raw.encode(x).latent * 0.5
        decoded = raw.decode(expected / 0.5).sample.clamp(-1, 1)
    latents = vae.encode(x)
    torch.testing.assert_close(latents, expected)
    torch.testing.assert_close(vae.decode(latents), decoded)
    with pytest.raises(ValueError, match="not a multiple of the VAE's factor 2"):
        vae.latent_shape(15, 24)


def test_kl_posterior_mean_or_a_seeded_sample_with_shift_and_scale(kl_dir):
    from diffusers import AutoencoderKL

    vae = build_autoencoder(kl_dir)
    scale, shift = vae.normalization.scale, vae.normalization.shift
    assert (float(scale), float(shift), vae.spatial_compression) == (pytest.approx(0.3), pytest.approx(0.1), 2)
    x = pixels()
    with torch.no_grad():
        dist = AutoencoderKL.from_pretrained(kl_dir).eval().encode(x).latent_dist
    torch.testing.assert_close(vae.encode(x), (dist.mean - 0.1) * 0.3)
    seeded = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]  # noqa: E731
    sampled = vae.encode(x, seeded())
    assert torch.equal(sampled, vae.encode(x, seeded()))  # a function of the per-sample generators
    noise = torch.stack([torch.randn(dist.mean.shape[1:], generator=g) for g in seeded()])
    torch.testing.assert_close(sampled, (dist.mean + dist.std * noise - 0.1) * 0.3)
    # a sample's latent does not depend on its batch neighbours
    alone = vae.encode(x[1:], [torch.Generator().manual_seed(2)])
    torch.testing.assert_close(alone[0], sampled[1], atol=1e-5, rtol=1e-5)


def test_an_image_vae_encodes_a_video_frame_by_frame(dc_ae_dir, kl_dir):
    dc_ae, kl = build_autoencoder(dc_ae_dir), build_autoencoder(kl_dir)
    frames = torch.rand(2, 3, 3, 16, 24, generator=torch.Generator().manual_seed(1)) * 2 - 1  # [B, 3, T, H, W]
    latents = dc_ae.encode(frames)
    assert latents.shape == (2, *dc_ae.latent_shape(16, 24, frames=3)) == (2, 4, 3, 8, 12)
    for t in range(3):
        torch.testing.assert_close(latents[:, :, t], dc_ae.encode(frames[:, :, t]))
    decoded = dc_ae.decode(latents)
    assert decoded.shape == frames.shape
    torch.testing.assert_close(decoded[:, :, 1], dc_ae.decode(latents[:, :, 1]))
    # a KL sample: one generator per video draws the noise of all its frames
    seeded = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]  # noqa: E731
    assert torch.equal(kl.encode(frames, seeded()), kl.encode(frames, seeded()))
    assert not torch.equal(kl.encode(frames, seeded()), kl.encode(frames))
    with pytest.raises(ValueError, match=r"pixels are \[B, 3, H, W\] or \[B, 3, T, H, W\], got shape \(2, 4, 16, 24\)"):
        dc_ae.encode(torch.zeros(2, 4, 16, 24))


def test_encoder_only_loading_drops_the_decoder(dc_ae_dir):
    vae = build_autoencoder(dc_ae_dir, keep_decoder=False, dtype=torch.bfloat16)
    assert vae.model.decoder is None and vae.dtype == torch.bfloat16
    assert vae.encode(pixels()).dtype == torch.float32
    with pytest.raises(RuntimeError, match="without its decoder"):
        vae.decode(torch.zeros(1, 4, 8, 12))


def test_bad_vae_folders_are_named(tmp_path, dc_ae_dir):
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        build_autoencoder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    with pytest.raises(ValueError, match="'_class_name' is 'UNet2DModel'; expected a diffusers autoencoder"):
        build_autoencoder(tmp_path)


def test_dc_ae_f32c32_config_builds_sanas_autoencoder():
    from diffusers import AutoencoderDC

    with torch.device("meta"):
        model = AutoencoderDC(**DC_AE_F32C32_CONFIG)
    assert model.spatial_compression_ratio == 32 and model.config.latent_channels == 32
    assert model.config.scaling_factor == 0.41407
    # the released dc-ae-f32c32-sana checkpoints hold 312.25M parameters (1.25 GB in float32)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 2) == 312.25
    assert set(TINY_DC_AE) == set(DC_AE_F32C32_CONFIG)  # the tests' tiny one sets the same fields
