"""The training optimizers: AdamW, and CAME (Sana's memory-saving default).

Both run unchanged on plain tensors and on FSDP2's DTensor parameters (sharded on dim 0, on a
1-D FSDP mesh or a 2-D (replicate, shard) HSDP mesh). CAME is written only with DTensor-aware
ops, so the statistics that span the sharded dim (column means, the update's RMS) are reduced
across ranks by DTensor itself, and a sharded run equals a single-process run on full tensors.
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from sana2.components.model_transforms import trainable_parameters

CAME_DEFAULT_BETAS = (0.9, 0.999, 0.9999)
CAME_DEFAULT_EPS = (1e-30, 1e-16)


def build_optimizer(model: nn.Module, config) -> torch.optim.Optimizer:
    """The [optimizer] section's optimizer over `model`'s trainable parameters.

    "adamw": torch.optim.AdamW (betas: 2 values, eps: 1); "came": CAME (betas: 3, eps: 2). The
    config has checked the name, the ranges and the number of values.
    """
    params = list(trainable_parameters(model).values())  # what the model transforms left trainable
    betas = tuple(config.betas)
    if config.name == "came":
        return CAME(params, lr=config.lr, weight_decay=config.weight_decay, betas=betas, eps=tuple(config.eps))
    # One multi-tensor kernel per step on an accelerator (DTensor registers itself as a foreach
    # type); on CPU the foreach path only loops, so use the plain per-tensor loop.
    foreach = all(p.device.type != "cpu" for p in params)
    return torch.optim.AdamW(
        params, lr=config.lr, weight_decay=config.weight_decay, betas=betas, eps=config.eps[0], foreach=foreach
    )


class CAME(torch.optim.Optimizer):
    """CAME: Confidence-guided Adaptive Memory Efficient Optimization (Luo et al., ACL 2023).

    Per step, with g the gradient (viewed as a matrix [shape[0], prod(shape[1:])] when it has 2
    or more dims):
      r, c  <- EMA_beta2 of the row / column means of g^2 + eps1     (factored second moment)
      u     =  g / sqrt(r c^T / mean(r)),  then  u /= max(1, RMS(u) / clip_threshold)
      m     <- EMA_beta1 of u
      R, C  <- EMA_beta3 of the row / column means of (u - m)^2 + eps2  (factored instability)
      p     <- p (1 - lr weight_decay) - lr m / sqrt(R C^T / mean(R))
    A 1-D parameter keeps an unfactored second moment v (u = g / sqrt(v)) and steps by lr m
    without the confidence factor, as the authors' reference implementation does.
    """

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple = CAME_DEFAULT_BETAS,
        eps: tuple = CAME_DEFAULT_EPS,
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
    ):
        if not lr > 0.0:
            raise ValueError(f"lr must be positive, got {lr}")
        if len(betas) != 3 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must be 3 values in [0, 1), got {betas}")
        if len(eps) != 2 or not all(value >= 0.0 for value in eps):
            raise ValueError(f"eps must be 2 non-negative values, got {eps}")
        if not clip_threshold > 0.0:
            raise ValueError(f"clip_threshold must be positive, got {clip_threshold}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be non-negative, got {weight_decay}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=tuple(eps), clip_threshold=clip_threshold, weight_decay=weight_decay
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict) -> None:
        if param.grad.is_sparse:
            raise RuntimeError("CAME does not support sparse gradients")
        grad = param.grad
        if grad.dtype in (torch.float16, torch.bfloat16):
            grad = grad.float()  # statistics of squared half-precision gradients underflow
        state = self.state[param]
        if not state:
            _init_state(state, grad)
        state["step"] += 1
        beta1, beta2, beta3 = group["betas"]
        eps1, eps2 = group["eps"]
        factored = grad.dim() >= 2

        second_moment = grad.square() + eps1
        if factored:
            second_moment = _matrix_view(second_moment)
            _ema_(state["exp_avg_sq_row"], _row_means(second_moment), beta2)
            _ema_(state["exp_avg_sq_col"], _column_means(second_moment), beta2)
            update = grad * _factored_rsqrt(state["exp_avg_sq_row"], state["exp_avg_sq_col"]).view(grad.shape)
        else:
            _ema_(state["exp_avg_sq"], second_moment, beta2)
            update = grad * state["exp_avg_sq"].rsqrt()
        update = update / (_rms(update) / group["clip_threshold"]).clamp(min=1.0)

        exp_avg = state["exp_avg"]
        _ema_(exp_avg, update, beta1)
        if factored:
            instability = _matrix_view((update - exp_avg).square() + eps2)
            _ema_(state["exp_avg_res_row"], _row_means(instability), beta3)
            _ema_(state["exp_avg_res_col"], _column_means(instability), beta3)
            update = exp_avg * _factored_rsqrt(state["exp_avg_res_row"], state["exp_avg_res_col"]).view(grad.shape)
        else:
            update = exp_avg

        if group["weight_decay"] != 0.0:
            param.mul_(1.0 - group["lr"] * group["weight_decay"])
        param.add_(_placed_like(update.to(param.dtype), param), alpha=-group["lr"])


def _init_state(state: dict, grad: torch.Tensor) -> None:
    """Zero statistics; each is zeros_like a reduction of the gradient so that, for a DTensor, it
    carries that reduction's placements (rows: sharded like dim 0; columns: replicated)."""
    state["step"] = torch.tensor(0.0)  # a tensor, so optimizer state dicts and DCP handle it like AdamW's
    state["exp_avg"] = torch.zeros_like(grad)
    if grad.dim() >= 2:
        matrix = _matrix_view(grad)
        for kind in ("sq", "res"):
            state[f"exp_avg_{kind}_row"] = torch.zeros_like(_row_means(matrix))
            state[f"exp_avg_{kind}_col"] = torch.zeros_like(_column_means(matrix))
    else:
        state["exp_avg_sq"] = torch.zeros_like(grad)


def _matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """[shape[0], prod(shape[1:])]: conv kernels factor like the linear map they apply."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))


def _replicated(tensor: torch.Tensor) -> torch.Tensor:
    """Reduce a DTensor's pending (Partial) placements now, so the result can be stored and reused."""
    if not isinstance(tensor, DTensor) or not any(p.is_partial() for p in tensor.placements):
        return tensor
    placements = [Replicate() if p.is_partial() else p for p in tensor.placements]
    return tensor.redistribute(tensor.device_mesh, placements)


def _row_means(matrix: torch.Tensor) -> torch.Tensor:
    return _mean_over(matrix, dim=1)


def _column_means(matrix: torch.Tensor) -> torch.Tensor:
    return _mean_over(matrix, dim=0)


def _mean_over(tensor: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The mean over `dim` (None: all), replicated where it spanned a sharded dim.

    sum / n rather than mean: over an unevenly sharded dim, DTensor's mean all-gathers the whole
    tensor, while a sum becomes Partial and is reduced by one all-reduce of the (smaller) result.
    """
    total = tensor.sum() if dim is None else tensor.sum(dim=dim)
    return _replicated(total / (tensor.numel() if dim is None else tensor.shape[dim]))


def _factored_rsqrt(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(row col^T / mean(row)), the rank-1 estimate's inverse root, as a matrix."""
    return (row / _mean_over(row)).rsqrt().unsqueeze(1) * col.rsqrt().unsqueeze(0)


def _rms(tensor: torch.Tensor) -> torch.Tensor:
    """Root mean square over the whole (global) tensor: a DTensor's norm is reduced across ranks."""
    return _replicated(tensor.norm()) / math.sqrt(tensor.numel())


def _ema_(average: torch.Tensor, value: torch.Tensor, beta: float) -> None:
    average.mul_(beta).add_(_placed_like(value, average), alpha=1.0 - beta)


def _placed_like(tensor: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`tensor` with `target`'s placements, as DTensor's in-place ops require.

    They can differ: a dim-0-sharded [1, n] matrix times a replicated [1, n] row broadcasts over a
    size-1 sharded dim, and DTensor resolves that by replicating the product.
    """
    if isinstance(tensor, DTensor) and tensor.placements != target.placements:
        return tensor.redistribute(target.device_mesh, target.placements)
    return tensor
