"""sana2's sampler is diffusers' SanaPipeline: same schedulers, same loop, same latents for the same weights.

A tiny random sana2 model is exported to diffusers' SanaTransformer2DModel (sana2's own export rules) and
both sample from the same noise and caption embeddings; nothing is downloaded.
"""

import pytest
import torch
from diffusers import SanaPipeline, SanaTransformer2DModel

from sana2.components.flow import shift_sigma
from sana2.components.schedulers import (
    build_scheduler,
    flow_sample,
    scheduler_config,
)
from sana2.distributed.initialize import init_weights
from sana2.formats.diffusers import diffusers_config, export_pieces
from sana2.models import build_model

L, C_CAP = 16, 32  # SanaMS_debug's caption shape


def exported_pair(overrides: dict):
    """A seeded sana2 SanaMS_debug and the diffusers transformer loaded strictly from its export."""
    model = build_model("SanaMS_debug", **overrides).eval()
    init_weights(model, seed=5)
    config = diffusers_config("SanaMS_debug", overrides)
    exported = {
        piece.name: piece.take(tensor).clone()
        for key, tensor in model.state_dict().items()
        for piece in export_pieces(key, False)
    }
    reference = SanaTransformer2DModel.from_config(config).eval()
    reference.load_state_dict(exported, strict=True)
    return model, reference


def captions(batch: int):
    generator = torch.Generator().manual_seed(1)
    embeds = torch.randn(batch, L, C_CAP, generator=generator)
    mask = torch.ones(batch, L, dtype=torch.long)
    mask[0, 9:] = 0
    null_embeds, null_mask = torch.randn(L, C_CAP, generator=generator), torch.zeros(L, dtype=torch.long)
    null_mask[:1] = 1  # the empty prompt: one token (BOS or EOS)
    return embeds, mask, null_embeds, null_mask


def test_dpm_solver_steps_sana2s_shifted_grid_and_euler_diffusers_own():
    dpm = build_scheduler(scheduler_config("dpm-solver", 3.0))
    dpm.set_timesteps(20)
    # the shifted linspace from 1 to 0, as sana2's training shifts sigma; diffusers spaces the unshifted grid
    # from 1 - 1/1000 (its timesteps are integers): within 4e-4
    shifted = shift_sigma(torch.linspace(1.0, 0.0, 21, dtype=torch.float64), 3.0)
    torch.testing.assert_close(dpm.sigmas.double(), shifted, atol=4e-4, rtol=0)
    assert round(dpm.sigmas[-2].item(), 3) == 0.136
    euler = build_scheduler(scheduler_config("euler", 3.0))
    euler.set_timesteps(20)
    assert len(euler.sigmas) == 21 and round(euler.sigmas[-2].item(), 4) == 0.0089
    with pytest.raises(ValueError, match="sana2 samples with DPMSolverMultistepScheduler"):
        build_scheduler({"_class_name": "DDIMScheduler"})


@pytest.mark.parametrize(
    "scheduler, overrides, cfg",
    [("dpm-solver", {}, 4.5), ("dpm-solver", {}, 1.0), ("euler", {"timestep_norm_scale_factor": 1000.0}, 4.5)],
    ids=["dpm-solver", "dpm-solver-no-guidance", "euler-fractional-timesteps"],
)
def test_sana2_sampler_gives_sana_pipelines_latents(scheduler, overrides, cfg):
    """Tolerance 1e-5 (float32): the same operations in the same order up to the two models' kernels.
    Euler's timesteps are fractional: the model is one whose timesteps are scaled (Sana 1.5 style), as a
    model with timestep_norm_scale_factor 1 truncates them like Sana's and diffusers' does not."""
    model, reference = exported_pair(overrides)
    embeds, mask, null_embeds, null_mask = captions(2)
    model.null_caption().copy_(null_embeds)
    noise = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    config = scheduler_config(scheduler, 3.0)
    ours = flow_sample(model, noise, embeds[:, None], mask, null_mask, 20, cfg, build_scheduler(config))
    pipeline = SanaPipeline(
        tokenizer=None, text_encoder=None, vae=None, transformer=reference, scheduler=build_scheduler(config)
    )
    pipeline.set_progress_bar_config(disable=True)
    theirs = pipeline(
        prompt_embeds=embeds,
        negative_prompt=None,
        prompt_attention_mask=mask,
        negative_prompt_embeds=null_embeds[None].expand(2, -1, -1),
        negative_prompt_attention_mask=null_mask[None].expand(2, -1),
        latents=noise.clone(),
        num_inference_steps=20,
        guidance_scale=cfg,
        height=256,
        width=256,
        use_resolution_binning=False,
        output_type="latent",
    ).images
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    difference = (ours - theirs).abs().max().item()
    assert difference < 1e-5, difference
    assert (ours - noise).abs().mean() > 0.1  # it did move


def test_a_guided_sample_needs_captions_of_the_null_captions_shape():
    model, _ = exported_pair({})
    embeds, mask, _, null_mask = captions(1)
    noise = torch.randn(1, 4, 8, 8)
    scheduler = build_scheduler(scheduler_config("dpm-solver", 1.0))
    with pytest.raises(ValueError, match="must match the null caption"):
        flow_sample(model, noise, embeds[:, None, :8], mask[:, :8], null_mask[:8], 2, 4.5, scheduler)
