"""Validation: grid layout, sampling (diffusers' schedulers) against closed forms, FSDP2 sampling and loss on 2
ranks."""

import pytest
import torch
from dist_utils import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from sana2.components.flow import model_timestep, noised, sample_sigmas
from sana2.components.sampling import make_grid
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.components.validator import ValidationError, Validator, validation_loss
from sana2.config import Encoding, Validation
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.parallelize import apply_fsdp
from sana2.models import build_model

WORLD_SIZE = 2
MODEL_SEED = 3
LOSS_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
NOISE_SEED = 11
NUM_HELD_OUT = 6

# -- make_grid -------------------------------------------------------------------------------------


def test_make_grid_layout_on_a_hand_example():
    # five 1 x 2 images holding [10 i + 1, 10 i + 2], three per row, framed by -1
    images = torch.tensor([[10.0 * i + 1, 10.0 * i + 2] for i in range(1, 6)]).view(5, 1, 1, 2)
    f = -1.0
    expected = torch.tensor(
        [
            [f, f, f, f, f, f, f, f, f, f],
            [f, 11, 12, f, 21, 22, f, 31, 32, f],
            [f, f, f, f, f, f, f, f, f, f],
            [f, 41, 42, f, 51, 52, f, f, f, f],
            [f, f, f, f, f, f, f, f, f, f],
        ]
    )[None]
    assert torch.equal(make_grid(images, nrow=3, padding=1, pad_value=f), expected)


def test_make_grid_keeps_channels_apart_and_caps_columns_at_the_image_count():
    images = torch.randn(2, 3, 4, 5)
    grid = make_grid(images, nrow=8, padding=2)
    assert grid.shape == (3, 4 + 2 * 2, 2 * (5 + 2) + 2)
    for channel in range(3):
        assert torch.equal(grid[channel], make_grid(images[:, channel : channel + 1], nrow=8, padding=2)[0])
    assert torch.equal(grid[:, 2:6, 9:14], images[1])


# -- sampling on toy fields with closed forms ----------------------------------------------------


class NullCaptionModel(nn.Module):
    """A toy model that offers its null caption, as the DiT does."""

    def __init__(self, null: torch.Tensor):
        super().__init__()
        self.register_buffer("null", null)

    def null_caption(self) -> torch.Tensor:
        return self.null


class CaptionField(NullCaptionModel):
    """v = the sum of the unmasked caption tokens, the same at every pixel, x and sigma."""

    def __init__(self, null: torch.Tensor):
        super().__init__(null)
        self.calls = []  # (timestep, training) per forward

    def forward(self, x, timestep, y, mask):
        self.calls.append((timestep.clone(), self.training))
        field = (y[:, 0] * mask[..., None]).sum(1)  # [B, C]
        return field[:, :, None, None].expand_as(x)


class LinearField(NullCaptionModel):
    """v = rate * x, whatever the caption: Euler multiplies x by (1 + rate (sigma' - sigma)) per step."""

    def __init__(self, rate: float, null: torch.Tensor):
        super().__init__(null)
        self.rate = rate

    def forward(self, x, timestep, y, mask):
        return self.rate * x


def toy_inputs(batch=3, channels=2, tokens=4, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(batch, channels, 3, 5, generator=generator, dtype=dtype)
    captions = torch.randn(batch, 1, tokens, channels, generator=generator, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=dtype)
    null = torch.randn(tokens, channels, generator=generator, dtype=dtype)
    return noise, captions, mask, null


NULL_MASK = torch.tensor([1, 0, 0, 0])  # the empty prompt's: one token


def scheduler(name: str, shift: float):
    return build_scheduler(scheduler_config(name, shift))


def euler_sigmas(steps: int, shift: float) -> torch.Tensor:
    """diffusers' flow-matching Euler grid: steps + 1 sigmas from 1 to 0."""
    grid = scheduler("euler", shift)
    grid.set_timesteps(steps)
    return grid.sigmas


def euler_sample(model, noise, captions, mask, steps, cfg_scale, shift):
    """diffusers' flow-matching Euler through sana2's sampler."""
    return flow_sample(model, noise, captions, mask, NULL_MASK, steps, cfg_scale, scheduler("euler", shift))


def test_constant_field_with_guidance_matches_the_closed_form():
    noise, captions, mask, null = toy_inputs()
    model = CaptionField(null).train()
    steps, cfg_scale, shift = 7, 4.0, 3.0
    x0 = euler_sample(model, noise, captions, mask, steps, cfg_scale, shift)

    # the Euler steps telescope: x0 = noise - v, with v = v_u + s (v_c - v_u)
    v_cond = (captions[:, 0] * mask[..., None]).sum(1)
    v_uncond = (null[None] * NULL_MASK[None, :, None]).sum(1)  # the null caption with its own mask
    guided = v_uncond + cfg_scale * (v_cond - v_uncond)
    torch.testing.assert_close(x0, noise - guided[:, :, None, None], atol=1e-5, rtol=0)

    # one forward per step over the [uncond; cond] batch, in eval mode, at the scheduler's timestep 1000 sigma
    expected_timesteps = euler_sigmas(steps, shift)[:-1] * 1000
    assert len(model.calls) == steps
    for (timestep, training), expected in zip(model.calls, expected_timesteps):
        assert not training
        torch.testing.assert_close(timestep, torch.full((2 * len(noise),), expected.item()))
    assert expected_timesteps[0] == 1000 and model.training


def test_linear_field_follows_the_shifted_schedule():
    noise, captions, mask, null = toy_inputs(dtype=torch.float64)
    rate, steps, shift = 0.7, 5, 3.0
    x0 = euler_sample(LinearField(rate, null), noise, captions, mask, steps, cfg_scale=2.0, shift=shift)
    sigmas = euler_sigmas(steps, shift).double()
    growth = torch.prod(1 + rate * (sigmas[1:] - sigmas[:-1]))
    # diffusers steps float32 latents with float32 sigmas
    torch.testing.assert_close(x0.double(), noise * growth, atol=1e-5, rtol=0)
    # an unshifted schedule would give a different product: the test sees the shift
    unshifted = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    assert abs(torch.prod(1 + rate * unshifted.diff()) - growth) > 1e-3


# -- building the validator from its sections ------------------------------------------------------


def validator_from_sections(model, tmp_path, validation: Validation) -> Validator:
    """A validator on one process, built from [validation] and [encoding] alone (no JobConfig)."""
    return Validator(
        validation,
        Encoding(),  # tiny-t5: 64-wide embeddings
        model,
        None,
        None,
        flow_shift=1.0,
        samples_folder=tmp_path / "samples",
        val_dir=None,
        latent_shape=(model.in_channels, 8, 8),
        dims=ParallelDims(1, 1),
        local_batch_size=2,
    )


def test_validator_is_built_from_its_sections_and_names_the_key_it_cannot_use(tmp_path):
    prompts = Validation(prompts=["the number 3"], images_per_prompt=2, num_loss_samples=0)
    digits = build_model("SanaMS_digits")  # 64-wide captions of 16 tokens, as tiny-t5 gives
    validator = validator_from_sections(digits, tmp_path, prompts)
    assert validator.caption_embeds.shape == (2, 1, 16, 64) and validator.noise.shape == (2, 1, 8, 8)
    assert validator.vae is None and validator.loss_batches == []
    # each setting that does not fit is a ValidationError naming its key (the trainer adds the config file)
    with pytest.raises(
        ValidationError, match=r"encoding.text_encoder = 'tiny-t5' gives caption embeddings of \(16, 64\)"
    ):
        validator_from_sections(debug_model(), tmp_path, prompts)  # SanaMS_debug takes 32-wide captions
    missing = Validation(prompts=["the number 3"], num_loss_samples=0, vae=str(tmp_path / "no-vae"))
    with pytest.raises(ValidationError, match=r"validation.vae = '.*no-vae': the validation VAE cannot be loaded"):
        validator_from_sections(digits, tmp_path, missing)


# -- sampling SanaMS_debug -----------------------------------------------------------------------


def debug_model() -> nn.Module:
    model = build_model("SanaMS_debug")
    init_weights(model, MODEL_SEED)
    return model


def sampling_inputs():
    """Noise [2, 4, 8, 8], captions [2, 1, 16, 32] and their mask, as every rank builds them."""
    generator = torch.Generator().manual_seed(5)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    captions = torch.randn(2, 1, 16, 32, generator=generator)
    mask = torch.zeros(2, 16)
    mask[0, :9], mask[1, :16] = 1, 1
    return noise, captions, mask


def single_caption_euler(model, noise, captions, mask, steps, shift):
    """Plain Euler on diffusers' grid with the conditional (or any single) caption, written out step by step."""
    sigmas = euler_sigmas(steps, shift)
    x = noise
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            timestep = (sigma * 1000).repeat(len(x))
            x = x + float(sigma_next - sigma) * model(x, timestep, captions, mask)
    return x


def test_cfg_one_is_the_conditional_sampler_and_cfg_zero_the_unconditional_one():
    model = debug_model().eval()
    noise, captions, mask = sampling_inputs()
    conditional = euler_sample(model, noise, captions, mask, steps=4, cfg_scale=1.0, shift=3.0)
    torch.testing.assert_close(
        conditional, single_caption_euler(model, noise, captions, mask, 4, 3.0), atol=1e-6, rtol=0
    )
    # cfg 0 runs the guidance batch and keeps only its null-caption half
    null = model.null_caption()[None, None].expand_as(captions)
    null_mask = torch.zeros(16)
    null_mask[0] = 1
    unconditional = flow_sample(model, noise, captions, mask, null_mask, 4, 0.0, scheduler("euler", 3.0))
    torch.testing.assert_close(
        unconditional, single_caption_euler(model, noise, null, null_mask.expand(2, -1), 4, 3.0), atol=1e-5, rtol=0
    )
    guided = flow_sample(model, noise, captions, mask, null_mask, 4, 4.5, scheduler("euler", 3.0))
    assert (guided - conditional).abs().max() > 1e-2
    assert not model.training


# -- held-out loss ---------------------------------------------------------------------------------


def held_out_samples():
    """NUM_HELD_OUT samples: latents [4, 8, 8], captions [1, 16, 32], masks of varying length."""
    generator = torch.Generator().manual_seed(9)
    latents = torch.randn(NUM_HELD_OUT, 4, 8, 8, generator=generator)
    captions = torch.randn(NUM_HELD_OUT, 1, 16, 32, generator=generator)
    mask = (torch.arange(16)[None] < torch.tensor([16, 3, 8, 12, 1, 5])[:, None]).float()
    return latents, captions, mask


def held_out_batches(indices: list[int], batch_size: int) -> list[dict]:
    latents, captions, mask = held_out_samples()
    batches = []
    for start in range(0, len(indices), batch_size):
        chosen = torch.tensor(indices[start : start + batch_size])
        batches.append(
            {
                "latents": latents[chosen],
                "caption_embeds": captions[chosen],
                "caption_mask": mask[chosen],
                "indices": chosen,
            }
        )
    return batches


def test_validation_loss_is_fixed_and_falls_when_training_on_its_samples():
    torch.manual_seed(0)
    model = debug_model().train()
    batches = held_out_batches(list(range(NUM_HELD_OUT)), batch_size=4)
    before = validation_loss(model, batches, LOSS_SIGMAS, NOISE_SEED)
    assert validation_loss(model, batches, LOSS_SIGMAS, NOISE_SEED) == before  # same noise every call
    assert model.training
    # another batch split of the same samples: the same terms
    regrouped = validation_loss(model, held_out_batches([5, 0, 3, 1, 4, 2], batch_size=1), LOSS_SIGMAS, NOISE_SEED)
    assert regrouped == pytest.approx(before, rel=1e-6)

    latents, captions, mask = held_out_samples()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(15):
        sigmas = sample_sigmas(NUM_HELD_OUT, shift=1.0, mean=0.0, std=1.0, generator=generator)
        x_t, target = noised(latents, torch.randn(latents.shape, generator=generator), sigmas)
        loss = ((model(x_t, model_timestep(sigmas), captions, mask) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = validation_loss(model, batches, LOSS_SIGMAS, NOISE_SEED)
    assert after < 0.9 * before, (before, after)


def dpm_sample(model):
    null_mask = torch.zeros(16)
    null_mask[0] = 1  # the empty prompt's
    return flow_sample(model, *sampling_inputs(), null_mask, 4, 4.5, scheduler("dpm-solver", 3.0))


# -- FSDP2 on 2 ranks ------------------------------------------------------------------------------


def _sharded_sampling_and_loss(rank, world_size, out_dir):
    with torch.device("meta"):
        model = build_model("SanaMS_debug")
    apply_fsdp(model, init_device_mesh("cpu", (world_size,)), param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, MODEL_SEED)  # the same full weights as debug_model(), sharded
    images = dpm_sample(model)
    # each rank holds every other sample, two of them per batch (batches of 2 and 1)
    loss = validation_loss(
        model, held_out_batches(list(range(rank, NUM_HELD_OUT, world_size)), 2), LOSS_SIGMAS, NOISE_SEED
    )
    uneven = held_out_batches([rank], 1) * (rank + 1)  # rank 0: one batch, rank 1: two
    try:
        validation_loss(model, uneven, LOSS_SIGMAS, NOISE_SEED)
        uneven_error = None
    except ValueError as error:
        uneven_error = str(error)
    torch.save({"images": images, "loss": loss, "uneven_error": uneven_error}, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("validation")
    run_distributed(_sharded_sampling_and_loss, WORLD_SIZE, out_dir)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.slow
def test_sharded_sampling_equals_the_unsharded_model(sharded_results):
    reference = dpm_sample(debug_model())
    # every rank ran the same forwards on the same inputs with all-gathered (exact) weights
    assert torch.equal(sharded_results[0]["images"], sharded_results[1]["images"])
    # fp32 all-gathers rebuild the weights bit for bit and the forwards are the same ops on the
    # same shapes, so the images came out bit-identical when this test was written. The 1e-5
    # leaves room for a kernel choosing another summation order on the all-gathered storage
    # (~1e-7 relative per forward, |x| ~ 4), carried through 4 steps with cfg 4.5 amplifying it
    torch.testing.assert_close(sharded_results[0]["images"], reference, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_sharded_validation_loss_equals_the_single_process_value(sharded_results):
    single = validation_loss(debug_model(), held_out_batches(list(range(NUM_HELD_OUT)), 4), LOSS_SIGMAS, NOISE_SEED)
    assert sharded_results[0]["loss"] == sharded_results[1]["loss"]
    assert sharded_results[0]["loss"] == pytest.approx(single, rel=1e-6)


@pytest.mark.slow
def test_uneven_batch_counts_fail_on_every_rank_instead_of_hanging(sharded_results):
    for result in sharded_results:
        assert "same number of batches" in result["uneven_error"]
