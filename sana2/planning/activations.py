"""The measured activation model: bytes per feature unit, by block kind, compute dtype, AC mode and batch regime.

`activations.json` beside this file is written by benchmarks/calibrate_activations.py (see its doc
and the README's "Will it fit?"). A block kind is the structure of a transformer block (attention
type and head size, norms, FFN type and ratio, rotary embedding); widths, token counts, caption
length and batch enter through the features of `sana2.planning.calibration`. One sample and
several samples are fitted apart: a few ops take a different path for a batch of one.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn
from torch.distributed.fsdp import FSDPModule

from sana2.planning.calibration import predict

CALIBRATION_FILE = Path(__file__).with_name("activations.json")
FORMAT = "sana2-activation-calibration"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


class CalibrationMissing(LookupError):
    """No measurement for this block kind, dtype or AC mode: the message says how to make one."""


def block_kind(model: nn.Module) -> str:
    """A name for the structure of the model's transformer blocks (not their sizes)."""
    block = model.blocks[0]
    attn, cross, mlp = block.attn, block.cross_attn, block.mlp
    # the model's own class: fully_shard makes a subclass (FSDPSanaMS) of it
    model_class = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    if hasattr(attn, "head_dim"):
        attention = f"{type(attn).__name__}(head_dim={attn.head_dim}, qk_norm={attn.qk_norm})"
    else:
        attention = f"{type(attn).__name__}(qk_norm={attn.qk_norm})"
    ratio = mlp.point_conv.conv.in_channels / model.hidden_size
    ffn = f"{type(mlp).__name__}(ratio={ratio:g}" + (
        f", t_kernel={mlp.t_conv.kernel_size[0]})" if hasattr(mlp, "t_conv") else ")"
    )
    rope = ", rope" if getattr(model, "use_rope", False) else ""
    return (
        f"{model_class.__name__}: {attention}, CrossAttention(norm={cross.cross_norm}, "
        f"fp32={cross.compute_in_fp32}), {ffn}{rope}"
    )


@dataclass(frozen=True)
class BlockActivations:
    retained: int
    forward_extra: int
    backward_extra: int


@dataclass(frozen=True)
class StepActivations:
    """Activation bytes of one micro-batch for a setup (the quantities of sana2.planning.calibration)."""

    stem_retained: int
    head_retained: int
    head_backward_extra: int
    none: BlockActivations  # a block without activation checkpointing
    full: BlockActivations  # a checkpointed block
    flowing_grad: int  # the gradient passed from block to block in backward

    def block(self, checkpointed: bool) -> BlockActivations:
        return self.full if checkpointed else self.none

    def saved(self, depth: int, checkpointed) -> int:
        """Saved activations at the end of the forward: stem, every block, head."""
        blocks = sum(self.block(checkpointed(i)).retained for i in range(depth))
        return self.stem_retained + blocks + self.head_retained


class ActivationModel:
    """Predicts a model's activation bytes from the calibration, for any batch and sample shape."""

    def __init__(self, model: nn.Module, calibration: dict | None = None):
        calibration = load_calibration() if calibration is None else calibration
        self.kind = block_kind(model)
        if self.kind not in calibration["kinds"]:
            raise CalibrationMissing(
                f"no activation calibration for blocks of kind {self.kind!r}; calibrated kinds: "
                f"{', '.join(sorted(calibration['kinds']))}. Measure it with "
                "`python benchmarks/calibrate_activations.py --model NAME [--model.KEY=VALUE ...]`"
            )
        self.fits = calibration["kinds"][self.kind]["fits"]
        self.width = model.hidden_size
        self.caption_channels = model.caption_shape[1]

    def for_setup(self, setup) -> StepActivations:
        """Activation bytes for a setup's local batch, sample shape, compute dtype and AC mode."""
        shape = {
            "batch": setup.local_batch,
            "tokens": setup.rank_tokens,  # with context parallelism, this rank's frames of the clip
            "caption_length": setup.caption_length,
            "width": self.width,
            "latent_elements": setup.rank_latent_elements,
            "caption_channels": self.caption_channels,
        }
        regime = "single_sample" if setup.local_batch == 1 else "batched"
        modes = {}
        for mode in ("none", "full"):
            try:
                modes[mode] = self.fits[setup.param_dtype][mode][regime]
            except KeyError:
                raise CalibrationMissing(
                    f"no activation calibration for {self.kind!r} at {setup.param_dtype}, AC {mode}, {regime}"
                ) from None
        # the embedders and the head are never checkpointed, but run next to blocks that are
        outside = modes["full" if setup.ac_mode == "full" else "none"]

        def bytes_of(coefficients, quantity):
            return round(predict(coefficients, shape, quantity))

        def block(coefficients):
            return BlockActivations(
                *(bytes_of(coefficients, q) for q in ("block_retained", "block_forward_extra", "block_backward_extra"))
            )

        return StepActivations(
            stem_retained=bytes_of(outside, "stem_retained"),
            head_retained=bytes_of(outside, "head_retained"),
            head_backward_extra=bytes_of(outside, "head_backward_extra"),
            none=block(modes["none"]),
            full=block(modes["full"]),
            flowing_grad=setup.local_batch * setup.rank_tokens * self.width * DTYPE_BYTES[setup.param_dtype],
        )


def load_calibration(path: Path = CALIBRATION_FILE) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CalibrationMissing(
            f"{path} is missing: run `python benchmarks/calibrate_activations.py` to measure it"
        ) from None
    if data.get("format") != FORMAT:
        raise CalibrationMissing(f"{path} is not a {FORMAT} file")
    return data
