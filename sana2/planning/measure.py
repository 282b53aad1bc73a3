"""What the plan is checked against: the live tensor bytes of real FSDP2 training steps on rank 0 of N ranks.

The model is built, transformed (LoRA, freezing), parallelised and stepped with the trainer's own components
over a fake process group (sana2/planning/dry_run.py's `fake_world`): every allocation FSDP, autograd, the
optimizer and the EMA make is real; only communication is not. `LiveBytes` counts them. The tests of
the plan (tests/test_plan.py) and benchmarks/bench_memory_plan.py compare a plan with this.
"""

from dataclasses import dataclass

import torch

from sana2.components.ema import EMA
from sana2.components.flow import FlowMatching
from sana2.components.model_transforms import apply_transforms, build_transforms
from sana2.components.optimizer import build_optimizer
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import materialize, parallelize_sana
from sana2.models import build_model
from sana2.planning.dry_run import fake_world
from sana2.planning.live_bytes import LiveBytes


@dataclass
class Measured:
    peak: int  # the largest live tensor bytes over the steps
    parameters: int  # bytes of this rank's parameter shards, trainable or frozen, after materialising
    gradients: int  # bytes of the gradient shards after the last backward (before the optimizer step)
    optimizer: int  # bytes of the optimizer state after the steps
    ema: int  # bytes of the EMA's shadow copies


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def measure_fsdp_steps(config, world_size: int, steps: int = 2, latent_shape=None) -> Measured:
    """Train `steps` optimizer steps of `config` as rank 0 of `world_size` on random latents (`latent_shape`,
    default the model's [in_channels, input_size, input_size]) and captions, counting live tensor bytes."""
    t = config.training
    with fake_world(config, world_size) as dims:
        with torch.device("meta"):
            model = build_model(config.model.name, **config.model.overrides)
        model = apply_transforms(model, build_transforms(config))
        parallelize_sana(model, dims, config.parallelism, t, config.activation_checkpoint, config.compile)
        latent_shape = tuple(latent_shape or (model.in_channels, model.input_size, model.input_size))
        caption_width = model.caption_shape[1]
        live = LiveBytes()
        with live:
            materialize(model, torch.device("cpu"), config.parallelism.cpu_offload)
            init_weights(model, t.seed)
            parameters = _local_bytes(model.parameters())
            optimizer = build_optimizer(model, config.optimizer)
            ema = EMA(model, t.ema_decay) if t.ema_decay > 0 else None
            flow = FlowMatching.from_config(t)
            generator = torch.Generator().manual_seed(0)
            batch, length = t.local_batch_size, config.caption_length
            gradients = 0
            for step in range(1, steps + 1):
                for micro in range(t.gradient_accumulation_steps):
                    model.set_requires_gradient_sync(micro == t.gradient_accumulation_steps - 1)
                    inputs = {
                        "latents": torch.randn(batch, *latent_shape, generator=generator),
                        "caption_embeds": torch.randn(batch, 1, length, caption_width, generator=generator),
                        "caption_mask": torch.ones(batch, length),
                    }
                    draw = flow.draw(step, torch.arange(batch), latent_shape)
                    flow.loss(model, inputs, draw).mean().backward()
                    del inputs, draw
                gradients = _local_bytes(p.grad for p in model.parameters() if p.grad is not None)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                optimizer.step()
                if ema is not None:
                    ema.update()
                optimizer.zero_grad(set_to_none=True)
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            optimizer_bytes = _local_bytes(v for v in state if v.ndim > 0)  # not AdamW's scalar step counts
            ema_bytes = _local_bytes(ema.shadow.values()) if ema is not None else 0
        return Measured(live.peak, parameters, gradients, optimizer_bytes, ema_bytes)
