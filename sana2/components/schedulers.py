"""Sampling as diffusers' SanaPipeline does it: diffusers' own schedulers, stepped through their public API.

Two schedulers, by their `--scheduler` / `validation.scheduler` names:
  * "dpm-solver": `DPMSolverMultistepScheduler` on flow sigmas (second-order multistep DPM-Solver++ with
    flow prediction), which Sana's released diffusers pipelines configure and `SanaPipeline` uses; 21
    points at 20 steps, the shifted linspace from 1 to 0 (last nonzero sigma 0.136 at shift 3).
  * "euler": `FlowMatchEulerDiscreteScheduler`, Sana's flow-matching Euler in diffusers (another grid:
    last nonzero sigma 0.0089 at 20 steps and shift 3).

The loop is SanaPipeline's: the model sees the scheduler's timestep t (sana2's model divides it by its
timestep_norm_scale_factor where SanaPipeline multiplies by timestep_scale); guidance in float32 mixes
v = v_u + cfg (v_c - v_u) of one [uncond; cond] forward, the unconditional half with the null caption's
own mask as diffusers' negative prompt has; the latents stay float32 and the scheduler steps them. A
model whose timestep_norm_scale_factor is 1 truncates fractional timesteps (as Sana's does; diffusers'
transformer does not), so with "euler" (fractional timesteps) such a model is not diffusers' to the bit.
"""

from typing import Any

import torch
from torch import nn

SCHEDULERS = ("dpm-solver", "euler")
DEFAULT_SCHEDULER = "dpm-solver"


def scheduler_config(name: str, flow_shift: float) -> dict[str, Any]:
    """The diffusers scheduler config (`_class_name` and its options) Sana's pipelines ship for `name`."""
    if name == "dpm-solver":
        return {
            "_class_name": "DPMSolverMultistepScheduler",
            "use_flow_sigmas": True,
            "flow_shift": flow_shift,
            "prediction_type": "flow_prediction",
            "solver_order": 2,
            "algorithm_type": "dpmsolver++",
        }
    if name == "euler":
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": flow_shift}
    raise ValueError(f"scheduler {name!r}: expected one of {', '.join(SCHEDULERS)}")


def build_scheduler(config: dict[str, Any]):
    """A diffusers scheduler from its config (scheduler_config's, or a pipeline's scheduler_config.json)."""
    import diffusers

    cls = getattr(diffusers, config.get("_class_name", ""), None)
    if cls is None or cls.__name__ not in ("DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler"):
        raise ValueError(
            f"scheduler {config.get('_class_name')!r}: sana2 samples with DPMSolverMultistepScheduler (on flow "
            f"sigmas) or FlowMatchEulerDiscreteScheduler"
        )
    return cls.from_config(config)


@torch.no_grad()
def flow_sample(
    model: nn.Module,
    noise: torch.Tensor,
    caption_embeds: torch.Tensor,
    caption_mask: torch.Tensor,
    null_mask: torch.Tensor,
    steps: int,
    cfg_scale: float,
    scheduler,
) -> torch.Tensor:
    """Latents x0 [B, C, ...] from `noise` (sigma 1) in `steps` steps of `scheduler` (a fresh diffusers one).

    caption_embeds: [B, 1, L, C_cap] with L the model's caption length; caption_mask: [B, L]; null_mask:
    [L], the mask of the model's null caption (the empty prompt's). With cfg_scale 1 the unconditional half
    is skipped. Every forward is the model's ordinary one, so a sharded model works alike (every rank calls).
    """
    batch_size = noise.shape[0]
    guided = cfg_scale != 1.0
    captions, masks = caption_embeds, caption_mask
    if guided:
        null = model.null_caption().to(device=caption_embeds.device, dtype=caption_embeds.dtype)
        null = null[None, None].expand(batch_size, 1, *null.shape)
        if null.shape != caption_embeds.shape:
            raise ValueError(
                f"caption_embeds {tuple(caption_embeds.shape)} must match the null caption "
                f"{tuple(null.shape)} (pad captions to the model's max length)"
            )
        null_masks = null_mask.to(caption_mask)[None].expand(batch_size, -1)
        captions, masks = torch.cat([null, caption_embeds]), torch.cat([null_masks, caption_mask])
    scheduler.set_timesteps(steps, device=noise.device)
    x = noise.float()
    was_training = model.training
    model.eval()
    try:
        for t in scheduler.timesteps:
            model_input = torch.cat([x, x]) if guided else x
            velocity = model(model_input, t.expand(model_input.shape[0]), captions, masks).float()
            if guided:
                v_uncond, v_cond = velocity.chunk(2)
                velocity = v_uncond + cfg_scale * (v_cond - v_uncond)
            x = scheduler.step(velocity, t, x, return_dict=False)[0]
    finally:
        model.train(was_training)
    return x
