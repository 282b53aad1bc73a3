"""Measure a Sana model's activation memory for one training step on CPU, and fit the plan's model of it.

`measure_step` runs one forward and backward of the trainer's objective (FlowMatching's loss, from
sana2/components/flow.py) on a plain, unsharded model, counting live tensor bytes (`LiveBytes`)
with hooks on the transformer blocks. It reports, in bytes:

- stem_retained        what the batch, the embedders and the rotary table leave alive at block 0's input
- block_retained       what one block's forward leaves alive for its backward (its output included)
- block_forward_extra  the peak inside a block's forward above what it leaves alive
- block_backward_extra the peak inside a block's backward above its start, its parameters' gradients
                       not included: they are allocated before the step, so backward accumulates into
                       them in place (FSDP's unsharded gradients are accounted for separately)
- head_retained        what the final layer and the loss add after the last block
- head_backward_extra  the peak of the loss's and final layer's backward above the end of the forward

`fit` turns measurements over a grid of (batch, tokens, caption length, width) into bytes per unit of
each feature below (least squares); `features` gives those units for one configuration, so the plan
predicts `sum(coefficient * feature)`.
"""

import math

import numpy as np
import torch

from sana2.components.flow import FlowMatching
from sana2.planning.live_bytes import LiveBytes

QUANTITIES = (
    "stem_retained",
    "block_retained",
    "block_forward_extra",
    "block_backward_extra",
    "head_retained",
    "head_backward_extra",
)

# the units activations grow with: tokens x width per sample, caption tokens x width per sample,
# width per sample (modulation, linear-attention state), and the raw inputs per sample
FEATURES = {
    "per_token_channel": lambda s: s["batch"] * s["tokens"] * s["width"],
    "per_caption_token_channel": lambda s: s["batch"] * s["caption_length"] * s["width"],
    "per_sample_channel": lambda s: s["batch"] * s["width"],
    "per_latent_element": lambda s: s["batch"] * s["latent_elements"],
    "per_caption_input_element": lambda s: s["batch"] * s["caption_length"] * s["caption_channels"],
    # temporaries the size of one weight (a weight's gradient before it is accumulated): width squared
    "per_squared_channel": lambda s: s["width"] ** 2,
}
_BLOCK = ("per_token_channel", "per_caption_token_channel", "per_sample_channel")
# which features each quantity may use: the inputs (latents, caption embeddings) only outside the blocks
_INPUTS = (*_BLOCK, "per_latent_element", "per_caption_input_element")
QUANTITY_FEATURES = {
    "stem_retained": _INPUTS,
    "block_retained": _BLOCK,
    "block_forward_extra": (*_BLOCK, "per_squared_channel"),
    "block_backward_extra": (*_BLOCK, "per_squared_channel"),
    "head_retained": _INPUTS,
    "head_backward_extra": (*_INPUTS, "per_squared_channel"),
}


def features(shape: dict, quantity: str) -> np.ndarray:
    """The feature values of `quantity` for one configuration `shape` (keys: batch, tokens,
    caption_length, width, latent_elements, caption_channels)."""
    return np.array([FEATURES[name](shape) for name in QUANTITY_FEATURES[quantity]], dtype=np.float64)


def predict(coefficients: dict, shape: dict, quantity: str) -> float:
    """Bytes of `quantity` for `shape` from fitted per-feature coefficients."""
    names = QUANTITY_FEATURES[quantity]
    return float(np.dot([coefficients[quantity][name] for name in names], features(shape, quantity)))


def fit(samples: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Least-squares coefficients per quantity from (shape, measured) pairs, in absolute bytes (so the
    large sizes, where the memory is, weigh most); returns them and `fit_errors` on the same samples."""
    coefficients = {}
    for quantity in QUANTITIES:
        matrix = np.stack([features(shape, quantity) for shape, _ in samples])
        measured = np.array([m[quantity] for _, m in samples], dtype=np.float64)
        solution, *_ = np.linalg.lstsq(matrix, measured, rcond=None)
        coefficients[quantity] = dict(zip(QUANTITY_FEATURES[quantity], (float(c) for c in solution)))
    return coefficients, fit_errors(coefficients, samples)


def fit_errors(coefficients: dict, samples: list[tuple[dict, dict]]) -> dict[str, float]:
    """Per quantity, the largest |predicted - measured| relative to what one block and the stem hold at
    their peak (stem + block retained + block backward extra): the scale on which errors matter."""
    errors = {}
    for quantity in QUANTITIES:
        errors[quantity] = max(
            abs(predict(coefficients, shape, quantity) - m[quantity])
            / (m["stem_retained"] + m["block_retained"] + m["block_backward_extra"])
            for shape, m in samples
        )
    return errors


def model_shape(model, batch: int, latent_shape: tuple[int, ...], caption_length: int) -> dict:
    """The feature inputs of a model and batch: tokens per sample as the model counts them."""
    return {
        "batch": batch,
        "tokens": model.num_tokens(tuple(latent_shape)),
        "caption_length": caption_length,
        "width": model.hidden_size,
        "latent_elements": math.prod(latent_shape),
        "caption_channels": model.caption_shape[1],
    }


def measure_step(model, batch: int, latent_shape: tuple[int, ...], caption_length: int) -> dict[str, int]:
    """Live bytes of one training forward and backward of `model` (plain, on CPU, already in the
    compute dtype, activation checkpointing applied or not) for `batch` samples; see the module doc."""
    blocks = list(model.blocks)
    if len(blocks) < 2:
        raise ValueError("measure_step needs a model with at least 2 blocks (block 1 shows a block in the chain)")
    caption_channels = model_shape(model, batch, latent_shape, caption_length)["caption_channels"]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    marks: dict[str, int] = {}
    live = LiveBytes(known=[*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())])

    def at(name, reset_peak=False, read_peak=None):
        backward = "backward" in name

        def hook(*_):
            if backward != ("loss" in marks):
                return  # activation checkpointing re-runs forward hooks during backward: keep the first
            if read_peak:
                marks[read_peak] = live.peak
            marks[name] = live.current
            if reset_peak:
                live.reset_peak()

        return hook

    probe = blocks[1]
    handles = [
        blocks[0].register_forward_pre_hook(at("stem_end")),
        probe.register_forward_pre_hook(at("block_start", reset_peak=True)),
        probe.register_forward_hook(at("block_end", read_peak="block_forward_peak")),
        blocks[-1].register_forward_hook(at("blocks_end")),
        blocks[-1].register_full_backward_pre_hook(at("head_backward_end", read_peak="head_backward_peak")),
        probe.register_full_backward_pre_hook(at("block_backward_start", reset_peak=True)),
        probe.register_full_backward_hook(at("block_backward_end", read_peak="block_backward_peak")),
    ]
    generator = torch.Generator().manual_seed(0)
    flow = FlowMatching(seed=0)
    try:
        with live:
            # the batch as the trainer holds it (latents, caption embeddings and mask in fp32, as the
            # feature reader gives them) and the trainer's objective with its per-sample draw
            inputs = {
                "latents": torch.randn(batch, *latent_shape, generator=generator),
                "caption_embeds": torch.randn(batch, 1, caption_length, caption_channels, generator=generator),
                "caption_mask": torch.ones(batch, caption_length),
            }
            draw = flow.draw(0, torch.arange(batch), tuple(latent_shape))
            loss = flow.loss(model, inputs, draw).mean()
            marks["loss"] = live.current
            live.reset_peak()
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return {
        "stem_retained": marks["stem_end"],
        "block_retained": marks["block_end"] - marks["block_start"],
        "block_forward_extra": marks["block_forward_peak"] - marks["block_end"],
        "block_backward_extra": marks["block_backward_peak"] - marks["block_backward_start"],
        "head_retained": marks["loss"] - marks["blocks_end"],
        "head_backward_extra": marks["head_backward_peak"] - marks["loss"],
    }
