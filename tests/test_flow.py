"""The flow objective: per-sample randomness that no batch split, world size or resume changes; the loss."""

import torch
from torch import nn

from sana2.components.flow import FlowMatching, model_timestep, noised

SHAPE = (2, 3, 3)


def test_a_samples_draw_depends_only_on_seed_step_and_index():
    flow = FlowMatching(seed=4, shift=3.0, caption_dropout=0.5)
    whole = flow.draw(7, torch.tensor([5, 9, 2, 11]), SHAPE)
    # the same samples, split otherwise and in another order (another rank, batch or micro-batch)
    part = flow.draw(7, torch.tensor([11, 9]), SHAPE)
    assert torch.equal(part.sigma, whole.sigma[[3, 1]]) and torch.equal(part.noise, whole.noise[[3, 1]])
    assert torch.equal(part.drop, whole.drop[[3, 1]])
    other_step = flow.draw(8, torch.tensor([5, 9, 2, 11]), SHAPE)
    assert not torch.equal(other_step.noise, whole.noise) and not torch.equal(other_step.sigma, whole.sigma)
    other_seed = FlowMatching(seed=5, shift=3.0, caption_dropout=0.5).draw(7, torch.tensor([5, 9, 2, 11]), SHAPE)
    assert not torch.equal(other_seed.noise, whole.noise)


def test_draws_follow_the_configured_distributions():
    flow = FlowMatching(seed=0, shift=3.0, logit_mean=0.0, logit_std=1.0, caption_dropout=0.25)
    draw = flow.draw(1, torch.arange(4000), (1,))
    assert draw.sigma.dtype == torch.float64 and 0 <= draw.sigma.min() and draw.sigma.max() < 1
    assert abs(draw.drop.float().mean().item() - 0.25) < 0.03
    assert abs(draw.noise.std().item() - 1) < 0.05
    # shift 3 moves the median noise level from 0.5 to 3 * 0.5 / (1 + 2 * 0.5) = 0.75
    assert abs(draw.sigma.median().item() - 0.75) < 0.03
    assert not FlowMatching(seed=0).draw(1, torch.arange(100), (1,)).drop.any()  # no dropout by default


class Recorder(nn.Module):
    """Predicts a fixed tensor and records what it was called with."""

    def __init__(self, prediction: torch.Tensor):
        super().__init__()
        self.prediction = prediction

    def forward(self, x, timestep, y, mask, drop_ids=None):
        self.seen = (x, timestep, drop_ids)
        return self.prediction


def test_the_loss_is_each_samples_mean_squared_error_of_its_v_prediction():
    generator = torch.Generator().manual_seed(0)
    batch = {
        "latents": torch.randn(3, *SHAPE, generator=generator),
        "caption_embeds": torch.randn(3, 1, 4, 5, generator=generator),
        "caption_mask": torch.ones(3, 4),
    }
    prediction = torch.randn(3, *SHAPE, generator=generator)
    model = Recorder(prediction)
    flow = FlowMatching(seed=1, caption_dropout=0.5)
    draw = flow.draw(2, torch.tensor([0, 1, 2]), SHAPE)
    loss = flow.loss(model, batch, draw)
    x_t, target = noised(batch["latents"], draw.noise, draw.sigma)
    assert torch.equal(model.seen[0], x_t) and torch.equal(model.seen[1], model_timestep(draw.sigma))
    assert torch.equal(model.seen[2], draw.drop)
    torch.testing.assert_close(loss, ((prediction - target) ** 2).mean(dim=(1, 2, 3)), atol=0, rtol=0)
    fixed = flow.draw_at(0.3, 0, torch.tensor([0, 1, 2]), SHAPE)
    assert fixed.drop is None and torch.equal(fixed.sigma, torch.full((3,), 0.3, dtype=torch.float64))
