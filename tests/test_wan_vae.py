"""The Wan VAE behind the autoencoder interface: per-channel normalisation as SanaVideoPipeline, images as
one-frame clips, float32, slicing and tiling."""

import pytest
import torch
from video_factory import tiny_wan_vae

from sana2.encoders.autoencoder import PerChannel, build_autoencoder


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return build_autoencoder(tiny_wan_vae(tmp_path_factory.mktemp("wan") / "vae"), dtype=torch.bfloat16)


def test_wan_vae_latents_are_normalised_per_channel(wan):
    assert (
        wan.is_video and isinstance(wan.normalization, PerChannel) and wan.dtype == torch.float32
    )  # Sana runs it in float32
    assert (wan.latent_channels, wan.spatial_compression, wan.temporal_compression) == (4, 8, 4)
    assert wan.latent_shape(32, 48, 9) == (4, 3, 4, 6) and wan.latent_shape(32, 48) == (4, 1, 4, 6)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        wan.latent_shape(32, 48, 8)
    clip = torch.rand(2, 3, 9, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = wan.encode(clip)
    assert latents.shape == (2, 4, 3, 4, 6) and latents.dtype == torch.float32
    raw = wan.model.encode(clip).latent_dist.mean
    mean = torch.tensor(wan.model.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(wan.model.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents, (raw - mean) / std)
    # slicing encodes one clip at a time: the same numbers as alone
    torch.testing.assert_close(latents[1:], wan.encode(clip[1:]), atol=1e-6, rtol=0)


def test_wan_vae_decodes_as_sana_video_pipeline_does(wan):
    latents = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(1))
    video = wan.decode(latents)
    assert video.shape == (1, 3, 5, 16, 24) and video.abs().max() <= 1
    mean = torch.tensor(wan.model.config.latents_mean).view(1, 4, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(wan.model.config.latents_std).view(1, 4, 1, 1, 1)
    expected = wan.model.decode(latents / inverse_std + mean).sample.clamp(-1, 1)
    torch.testing.assert_close(video, expected)


def test_an_image_is_a_one_frame_clip(wan):
    images = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = wan.encode(images)
    assert latents.shape == (2, 4, 1, 2, 2)
    torch.testing.assert_close(latents, wan.encode(images.unsqueeze(2)))
    assert wan.decode(latents).shape == (2, 3, 1, 16, 16)


def test_posterior_samples_are_seeded_and_tiling_is_an_option(wan, tmp_path):
    clip = torch.zeros(1, 3, 5, 16, 16)
    draw = lambda: wan.encode(clip, [torch.Generator().manual_seed(7)])  # noqa: E731
    torch.testing.assert_close(draw(), draw())
    assert not torch.equal(draw(), wan.encode(clip))
    tiled = build_autoencoder(tiny_wan_vae(tmp_path / "vae"), tiling=True, keep_decoder=False)
    assert tiled.model.use_tiling and tiled.model.use_slicing and tiled.model.decoder is None
    with pytest.raises(RuntimeError, match="without its decoder"):
        tiled.decode(torch.zeros(1, 4, 1, 2, 2))
