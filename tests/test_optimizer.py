"""CAME and AdamW on plain and FSDP2-sharded parameters, CAME checkpointing, and the lr schedules."""

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from sana2.components.lr_scheduler import build_lr_scheduler
from sana2.components.optimizer import CAME, build_optimizer
from sana2.config import LRScheduler, Optimizer
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import apply_fsdp
from sana2.models import build_model


def came_config(lr: float, weight_decay: float = 0.0) -> Optimizer:
    """An [optimizer] section for CAME with Sana's betas and eps."""
    return Optimizer(name="came", lr=lr, weight_decay=weight_decay, betas=[0.9, 0.999, 0.9999], eps=[1e-30, 1e-16])


# -- CAME in one process ---------------------------------------------------------------------------


def test_came_reduces_a_least_squares_loss():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 16, generator=generator)
    targets = inputs @ torch.randn(16, 8, generator=generator) + 0.5
    model = nn.Linear(16, 8)
    optimizer = build_optimizer(model, came_config(lr=1e-2))
    losses = []
    for _ in range(100):
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]


def paper_came_matrix(theta, grads, lr, betas, eps, clip_threshold, weight_decay):
    """Algorithm 1 of the CAME paper, written with its sums (1_m, 1_n) and outer products."""
    beta1, beta2, beta3 = betas
    eps1, eps2 = eps
    n, m = theta.shape
    ones_n, ones_m = torch.ones(n, 1, dtype=theta.dtype), torch.ones(m, 1, dtype=theta.dtype)
    r, c = torch.zeros(n, 1, dtype=theta.dtype), torch.zeros(1, m, dtype=theta.dtype)
    big_r, big_c = torch.zeros_like(r), torch.zeros_like(c)
    momentum = torch.zeros_like(theta)
    for g in grads:
        r = beta2 * r + (1 - beta2) * (g**2 + eps1 * ones_n @ ones_m.T) @ ones_m
        c = beta2 * c + (1 - beta2) * ones_n.T @ (g**2 + eps1 * ones_n @ ones_m.T)
        v = r @ c / (ones_n.T @ r)
        u = g / v.sqrt()
        u_hat = u / max(1.0, (u.square().sum() / (n * m)).sqrt().item() / clip_threshold)
        momentum = beta1 * momentum + (1 - beta1) * u_hat
        instability = (u_hat - momentum) ** 2
        big_r = beta3 * big_r + (1 - beta3) * (instability + eps2 * ones_n @ ones_m.T) @ ones_m
        big_c = beta3 * big_c + (1 - beta3) * ones_n.T @ (instability + eps2 * ones_n @ ones_m.T)
        s = big_r @ big_c / (ones_n.T @ big_r)
        theta = theta - lr * weight_decay * theta - lr * momentum / s.sqrt()
    return theta


def paper_came_vector(theta, grads, lr, betas, eps, clip_threshold, weight_decay):
    """The unfactored form for 1-D parameters (the reference implementation steps by m alone)."""
    beta1, beta2, _ = betas
    v, momentum = torch.zeros_like(theta), torch.zeros_like(theta)
    for g in grads:
        v = beta2 * v + (1 - beta2) * (g**2 + eps[0])
        u = g / v.sqrt()
        u_hat = u / max(1.0, (u.square().mean()).sqrt().item() / clip_threshold)
        momentum = beta1 * momentum + (1 - beta1) * u_hat
        theta = theta - lr * weight_decay * theta - lr * momentum
    return theta


def test_came_matches_the_papers_formulas():
    hyper = dict(lr=0.1, betas=(0.8, 0.9, 0.95), eps=(1e-30, 1e-16), clip_threshold=1.5, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    matrix = torch.randn(2, 3, generator=generator, dtype=torch.float64)
    vector = torch.randn(2, generator=generator, dtype=torch.float64)
    grads = [
        (
            torch.randn(2, 3, generator=generator, dtype=torch.float64),
            torch.randn(2, generator=generator, dtype=torch.float64),
        )
        for _ in range(2)
    ]

    # the same matrix shaped as a conv kernel [out, in, kh, kw] must factor over [out, in * kh * kw]
    params = [nn.Parameter(matrix.clone()), nn.Parameter(vector.clone()), nn.Parameter(matrix.view(2, 1, 1, 3).clone())]
    optimizer = CAME(params, **hyper)
    for matrix_grad, vector_grad in grads:
        params[0].grad, params[1].grad, params[2].grad = matrix_grad, vector_grad, matrix_grad.view(2, 1, 1, 3)
        optimizer.step()

    expected_matrix = paper_came_matrix(matrix, [g for g, _ in grads], **hyper)
    expected_vector = paper_came_vector(vector, [g for _, g in grads], **hyper)
    torch.testing.assert_close(params[0].detach(), expected_matrix, rtol=1e-12, atol=0)
    torch.testing.assert_close(params[1].detach(), expected_vector, rtol=1e-12, atol=0)
    torch.testing.assert_close(params[2].detach().view(2, 3), expected_matrix, rtol=1e-12, atol=0)


def test_came_state_is_factored_and_made_of_tensors():
    conv, bias = nn.Parameter(torch.randn(4, 3, 2, 2)), nn.Parameter(torch.randn(4))
    optimizer = CAME([conv, bias], lr=1e-3)
    conv.grad, bias.grad = torch.randn_like(conv), torch.randn_like(bias)
    optimizer.step()
    shapes = {key: tuple(value.shape) for key, value in optimizer.state[conv].items()}
    assert shapes == {
        "step": (),
        "exp_avg": (4, 3, 2, 2),
        "exp_avg_sq_row": (4,),
        "exp_avg_sq_col": (12,),
        "exp_avg_res_row": (4,),
        "exp_avg_res_col": (12,),
    }
    assert set(optimizer.state[bias]) == {"step", "exp_avg", "exp_avg_sq"}
    assert all(isinstance(value, torch.Tensor) for state in optimizer.state.values() for value in state.values())
    assert optimizer.state[conv]["step"].item() == 1.0


def test_build_optimizer_follows_the_optimizer_config():
    model = nn.Linear(4, 4)
    adamw = build_optimizer(model, Optimizer(name="adamw", lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], eps=[1e-8]))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.9, 0.95)
    assert adamw.defaults["weight_decay"] == 0.1 and adamw.defaults["eps"] == 1e-8
    came = build_optimizer(model, came_config(lr=1e-4))
    assert isinstance(came, CAME) and came.defaults["betas"] == (0.9, 0.999, 0.9999)
    assert came.defaults["eps"] == (1e-30, 1e-16)
    assert CAME(model.parameters(), lr=1e-4, clip_threshold=2.0).defaults["clip_threshold"] == 2.0
    with pytest.raises(ValueError, match="betas"):
        CAME(model.parameters(), lr=1e-4, betas=(0.9, 0.999))


# -- sharded runs (2 gloo processes) against one process -----------------------------------------

STEPS = 3
BATCH = 4
OPTIMIZER_SETTINGS = {
    "came": came_config(lr=1e-3, weight_decay=0.01),
    "adamw": Optimizer(name="adamw", lr=1e-3, weight_decay=0.01, betas=[0.9, 0.999], eps=[1e-8]),
}
# fp32 sums run in a different order sharded (reduce-scatter of two half-batch gradients, all-
# reduces of partial column sums and norms) than in one process, so results differ by rounding
# (~1e-7 relative per step; measured <= 1e-6 after 3 steps for both optimizers). 1e-5 bounds that
# with margin, and stays far below one step's parameter change (asserted), so real errors show.
SHARDED_TOLERANCE = 1e-5


def fixed_batch() -> dict:
    generator = torch.Generator().manual_seed(123)
    mask = torch.ones(BATCH, 16)
    mask[1, 10:] = 0
    return dict(
        x=torch.randn(BATCH, 4, 8, 8, generator=generator),
        timestep=torch.randint(0, 1000, (BATCH,), generator=generator),
        y=torch.randn(BATCH, 1, 16, 32, generator=generator),
        mask=mask,
        target=torch.randn(BATCH, 4, 8, 8, generator=generator),
    )


def rank_slice(batch: dict, rank: int, world_size: int) -> dict:
    per_rank = BATCH // world_size
    return {key: value[rank * per_rank : (rank + 1) * per_rank] for key, value in batch.items()}


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict) -> None:
    no_caption_dropout = torch.zeros(batch["x"].shape[0], dtype=torch.bool)
    out = model(batch["x"], batch["timestep"], batch["y"], mask=batch["mask"], drop_ids=no_caption_dropout)
    loss = nn.functional.mse_loss(out, batch["target"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def freeze_noise_driven_parameters(model: nn.Module) -> nn.Module:
    """Freeze the cross-attention kv biases: the key half's true gradient is zero (softmax ignores a
    shift shared by all keys), so what it receives is rounding noise (~1e-11), which CAME (eps1 =
    1e-30, no floor) normalises into full +-lr steps whose signs differ between any two summation
    orders. Those entries would compare rounding noise, not the optimizer."""
    for name, param in model.named_parameters():
        if name.endswith("cross_attn.kv_linear.bias"):
            param.requires_grad_(False)
    return model


def unsharded_model() -> nn.Module:
    model = build_model("SanaMS_debug")
    init_weights(model, seed=0)
    return freeze_noise_driven_parameters(model)


def sharded_model(mesh, seed: int = 0) -> nn.Module:
    with torch.device("meta"):
        model = build_model("SanaMS_debug")
    apply_fsdp(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, seed=seed)
    return freeze_noise_driven_parameters(model)


def single_process_params(optimizer_name: str) -> tuple[dict, dict]:
    """(initial, final) full parameters of the unsharded run on the whole batch."""
    model = unsharded_model()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, OPTIMIZER_SETTINGS[optimizer_name])
    for _ in range(STEPS):
        train_step(model, optimizer, fixed_batch())
    return initial, {name: p.detach() for name, p in model.named_parameters()}


def check_sharded_training_matches_single_process(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    gathered = {}
    for optimizer_name in OPTIMIZER_SETTINGS:
        model = sharded_model(mesh)
        optimizer = build_optimizer(model, OPTIMIZER_SETTINGS[optimizer_name])
        for _ in range(STEPS):
            train_step(model, optimizer, rank_slice(fixed_batch(), rank, world_size))
        gathered[optimizer_name] = {name: p.full_tensor() for name, p in model.named_parameters()}
    # every collective is done: a failing comparison on one rank cannot leave the other waiting
    for optimizer_name, sharded in gathered.items():
        initial, expected = single_process_params(optimizer_name)
        moved = max((expected[name] - initial[name]).abs().max().item() for name in expected)
        assert moved > 100 * SHARDED_TOLERANCE, f"{optimizer_name}: parameters barely moved ({moved})"
        for name, value in sharded.items():
            torch.testing.assert_close(
                value,
                expected[name],
                atol=SHARDED_TOLERANCE,
                rtol=0,
                msg=lambda m, name=name, optimizer_name=optimizer_name: f"{optimizer_name} {name}: {m}",
            )


@pytest.mark.slow
def test_sharded_came_and_adamw_match_a_single_process_run():
    run_distributed(check_sharded_training_matches_single_process, 2)


class UnevenShapes(nn.Module):
    """Parameters whose dim 0 does not split evenly over 2 ranks; some leave rank 1 an empty shard."""

    SHAPES = {"matrix": (3, 5), "one_row": (1, 4), "kernel": (3, 2, 2), "vector": (5,), "scalar_like": (1,)}

    def __init__(self):
        super().__init__()
        for name, shape in self.SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))


def uneven_values(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in UnevenShapes.SHAPES.items()}


def came_on_uneven_shapes(mesh) -> dict:
    """The full parameters after STEPS CAME steps with fixed gradients, sharded on `mesh` (None: not)."""
    module = UnevenShapes()
    if mesh is not None:
        fully_shard(module, mesh=mesh)
        # dim 0 sharded over the mesh's last dim, replicated over the first on an HSDP mesh
        expected_placements = (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))
        assert all(p.placements == expected_placements for p in module.parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            _assign(param, uneven_values(seed=0)[name])
    optimizer = CAME(module.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        grads = uneven_values(seed=step + 1)
        for name, param in module.named_parameters():
            param.grad = _distributed_like(param, grads[name])
        optimizer.step()
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for name, p in module.named_parameters()}


def _distributed_like(template: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    if isinstance(template, DTensor):
        return distribute_tensor(full, template.device_mesh, template.placements, src_data_rank=None)
    return full


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        param.to_local().copy_(_distributed_like(param, full).to_local())
    else:
        param.copy_(full)


def check_uneven_shards_on_fsdp_and_hsdp_meshes(rank, world_size):
    fsdp_mesh = init_device_mesh("cpu", (world_size,))
    hsdp_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    results = {"fsdp": came_on_uneven_shapes(fsdp_mesh), "hsdp": came_on_uneven_shapes(hsdp_mesh)}
    expected = came_on_uneven_shapes(mesh=None)
    for mesh_name, params in results.items():
        for name, value in params.items():
            torch.testing.assert_close(
                value,
                expected[name],
                atol=SHARDED_TOLERANCE,
                rtol=0,
                msg=lambda m, name=name, mesh_name=mesh_name: f"{mesh_name} {name}: {m}",
            )


@pytest.mark.slow
def test_came_on_uneven_and_empty_shards_matches_a_single_process_run():
    run_distributed(check_uneven_shards_on_fsdp_and_hsdp_meshes, 2)


def check_came_checkpoint_resumes_bit_exactly(rank, world_size, checkpoint_dir):
    mesh = init_device_mesh("cpu", (world_size,))
    batch = rank_slice(fixed_batch(), rank, world_size)
    model = sharded_model(mesh)
    optimizer = build_optimizer(model, OPTIMIZER_SETTINGS["came"])
    for _ in range(2):
        train_step(model, optimizer, batch)
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": get_model_state_dict(model), "optim": optimizer_state}, checkpoint_id=checkpoint_dir)
    qkv_state = optimizer_state["state"]["blocks.0.attn.qkv.weight"]
    assert qkv_state["exp_avg_sq_row"].placements == (Shard(0),)
    assert qkv_state["exp_avg_sq_col"].placements == (Replicate(),)
    train_step(model, optimizer, batch)
    continued = {name: p.to_local().clone() for name, p in model.named_parameters()}

    # a fresh model from another seed: everything that matches afterwards came from the checkpoint
    resumed_model = sharded_model(mesh, seed=1)
    resumed_optimizer = build_optimizer(resumed_model, OPTIMIZER_SETTINGS["came"])
    state = {
        "model": get_model_state_dict(resumed_model),
        "optim": get_optimizer_state_dict(resumed_model, resumed_optimizer),
    }
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(resumed_model, state["model"])
    set_optimizer_state_dict(resumed_model, resumed_optimizer, state["optim"])
    assert all(s["step"].item() == 2 for s in resumed_optimizer.state.values())
    train_step(resumed_model, resumed_optimizer, batch)
    for name, param in resumed_model.named_parameters():
        assert torch.equal(param.to_local(), continued[name]), name


@pytest.mark.slow
def test_sharded_came_state_resumes_bit_exactly_through_dcp(tmp_path):
    run_distributed(check_came_checkpoint_resumes_bit_exactly, 2, str(tmp_path / "checkpoint"))


# -- learning-rate schedules -----------------------------------------------------------------------


def schedule(decay: str, warmup_steps: int, min_lr_ratio: float = 0.0, **_) -> LRScheduler:
    return LRScheduler(warmup_steps=warmup_steps, decay_type=decay, min_lr_ratio=min_lr_ratio)


def lr_values(decay: str, steps: list[int], **kwargs) -> list[float]:
    """The optimizer's lr after stepping the scheduler to each of `steps` (base lr 1.0)."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, schedule(decay, **kwargs), kwargs["total_steps"])
    values = []
    for step in range(max(steps) + 1):
        if step in steps:
            values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


SCHEDULE = dict(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
PROBE_STEPS = [0, 5, 10, 35, 60, 85, 110, 150]


def stepped_scheduler(lr: float, steps: int = 0):
    """An optimizer at base `lr` under the cosine SCHEDULE, and its scheduler, after `steps` steps."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_lr_scheduler(optimizer, schedule("cosine", **SCHEDULE), SCHEDULE["total_steps"])
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def test_constant_schedule_warms_up_then_holds():
    assert lr_values("constant", PROBE_STEPS, **SCHEDULE) == pytest.approx([0.0, 0.5, 1, 1, 1, 1, 1, 1])


def test_cosine_schedule_decays_to_the_floor():
    # after warmup: 0.1 + 0.9 * (1 + cos(pi * progress)) / 2, progress = (step - 10) / 100
    expected = [0.0, 0.5] + [0.1 + 0.45 * (1 + math.cos(math.pi * p)) for p in (0, 0.25, 0.5, 0.75, 1, 1)]
    assert lr_values("cosine", PROBE_STEPS, **SCHEDULE) == pytest.approx(expected)
    assert expected[4] == pytest.approx(0.55)


def test_linear_schedule_decays_to_the_floor():
    assert lr_values("linear", PROBE_STEPS, **SCHEDULE) == pytest.approx([0.0, 0.5, 1, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_no_warmup_starts_at_the_full_lr():
    assert lr_values("cosine", [0, 100], warmup_steps=0, total_steps=100) == pytest.approx([1.0, 0.0])


def test_scheduler_state_dict_round_trip():
    optimizer, scheduler = stepped_scheduler(2.0, 37)
    saved = scheduler.state_dict()

    resumed_optimizer, resumed = stepped_scheduler(2.0)
    resumed.load_state_dict(saved)
    assert resumed.last_epoch == 37 and resumed.get_last_lr() == scheduler.get_last_lr()
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        resumed_optimizer.step()
        resumed.step()
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_scheduler_state_survives_dcp_and_loads_into_a_plain_lambda_lr(tmp_path):
    optimizer, scheduler = stepped_scheduler(2.0, 37)
    dcp.save({"lr_scheduler": scheduler.state_dict()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "scheduler.pt")  # what an export writes
    saved = torch.load(tmp_path / "scheduler.pt", weights_only=False)["lr_scheduler"]
    assert saved["lr_lambdas"] == [None]  # DCP drops LambdaLR's own [{}], and its load needs the key

    plain_optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=2.0)
    plain = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, lambda step: 1.0)
    plain.load_state_dict(dict(saved))
    assert plain.last_epoch == 37 and plain.get_last_lr() == scheduler.get_last_lr()

    resumed_optimizer, resumed = stepped_scheduler(2.0)
    template = {"lr_scheduler": resumed.state_dict()}
    dcp.load(template, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    resumed.load_state_dict(template["lr_scheduler"])
    optimizer.step(), scheduler.step(), resumed_optimizer.step(), resumed.step()
    assert resumed.last_epoch == 38 and resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]


def test_a_resume_may_change_the_lr_and_keeps_the_position_in_the_schedule():
    optimizer, scheduler = stepped_scheduler(2.0, 37)
    saved = scheduler.state_dict()
    # the optimizer's own state restores the old group lr first, as a resume does
    resumed_optimizer, resumed = stepped_scheduler(0.5)
    resumed_optimizer.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]
    resumed.load_state_dict(saved)
    assert resumed.base_lrs == [0.5] and resumed.last_epoch == 37
    for _ in range(5):
        assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(optimizer.param_groups[0]["lr"] / 4)
        assert resumed.get_last_lr() == [resumed_optimizer.param_groups[0]["lr"]]
        optimizer.step(), scheduler.step(), resumed_optimizer.step(), resumed.step()


def test_scheduler_state_holds_only_plain_values():
    optimizer, scheduler = stepped_scheduler(2.0)
    state = scheduler.state_dict()
    assert state.keys() == torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict().keys()
    assert all(isinstance(v, (int, float, bool, list)) for v in state.values()), state
