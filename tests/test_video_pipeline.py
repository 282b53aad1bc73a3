"""A sana2 video model exported to diffusers' SanaVideoTransformer3DModel runs in diffusers' SanaVideoPipeline
with the same Wan VAE and gives the frames sana2's sampler and Wan decoding give, for the same noise,
captions, scheduler and steps. Tiny random models; nothing is downloaded."""

import pytest
import torch
from video_factory import tiny_wan_vae

from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.distributed.initialize import init_weights
from sana2.encoders.autoencoder import build_autoencoder
from sana2.formats.diffusers import diffusers_config, export_pieces
from sana2.models import build_model

diffusers = pytest.importorskip("diffusers")
L, C_CAP = 16, 32
# diffusers fixes the cross-attention q/k RMSNorm eps at 1e-5 where Sana's is 1e-6: off here, to compare exactly
TINY_VIDEO = dict(
    depth=2,
    hidden_size=64,
    num_heads=2,
    linear_head_dim=32,
    in_channels=4,
    caption_channels=C_CAP,
    model_max_length=L,
    input_size=8,
    qk_norm=False,
    cross_norm=False,
)


def test_sana2_video_sampling_gives_sana_video_pipelines_frames(tmp_path):
    """DPM-Solver (the pipelines' scheduler; its timesteps are whole numbers). Tolerance: latents 1e-5
    (float32, the same operations up to the two models' kernels); frames 1e-4 in [-1, 1] after the Wan decoder.
    (Euler's fractional timesteps are truncated by Sana's video model as by Sana's, not by diffusers', and
    SanaVideoTransformer3DModel has no timestep scale to express a model that would not truncate them.)"""
    scheduler, overrides = "dpm-solver", TINY_VIDEO
    model = build_model("SanaMSVideo", **overrides).eval()
    init_weights(model, seed=5)
    exported = {
        piece.name: piece.take(tensor).clone()
        for key, tensor in model.state_dict().items()
        for piece in export_pieces(key, True)
    }
    config = diffusers_config("SanaMSVideo", overrides)
    transformer = diffusers.SanaVideoTransformer3DModel.from_config(config).eval()
    transformer.load_state_dict(exported, strict=True)
    wan = build_autoencoder(tiny_wan_vae(tmp_path / "vae"))

    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(1, L, C_CAP, generator=generator)
    mask = torch.ones(1, L, dtype=torch.long)
    mask[0, 9:] = 0
    null_embeds, null_mask = torch.randn(L, C_CAP, generator=generator), torch.zeros(L, dtype=torch.long)
    null_mask[:1] = 1
    model.null_caption().copy_(null_embeds)
    noise = torch.randn(1, 4, 3, 4, 8, generator=torch.Generator().manual_seed(2))  # 9 frames of 32x64
    schedule = scheduler_config(scheduler, 3.0)

    latents = flow_sample(model, noise, embeds[:, None], mask, null_mask, 6, 4.5, build_scheduler(schedule))
    ours = wan.decode(latents)  # [1, 3, 9, 32, 64] in [-1, 1]: what sana2-sample writes

    pipeline = diffusers.SanaVideoPipeline(
        tokenizer=None, text_encoder=None, vae=wan.model, transformer=transformer, scheduler=build_scheduler(schedule)
    )
    pipeline.set_progress_bar_config(disable=True)
    call = dict(
        prompt_embeds=embeds,
        negative_prompt=None,
        prompt_attention_mask=mask,
        negative_prompt_embeds=null_embeds[None],
        negative_prompt_attention_mask=null_mask[None],
        latents=noise.clone(),
        num_inference_steps=6,
        guidance_scale=4.5,
        height=32,
        width=64,
        frames=9,
        use_resolution_binning=False,
    )
    their_latents = pipeline(**call, output_type="latent").frames
    assert (latents - their_latents).abs().max().item() < 1e-5
    frames = pipeline(**call, output_type="pt").frames  # [B, T, C, H, W] in [0, 1]
    theirs = frames.permute(0, 2, 1, 3, 4) * 2 - 1
    assert ours.shape == theirs.shape == (1, 3, 9, 32, 64)
    difference = (ours - theirs).abs().max().item()
    assert difference < 1e-4, difference
    assert (latents - noise).abs().mean() > 0.1  # it did move
