"""Context parallelism: a clip's frames split over cp ranks give one rank's loss, gradients and weights."""

import pytest
import torch
from dist_utils import run_distributed

from sana2.distributed.context_parallel import (
    ContextParallel,
    ContextParallelError,
    apply_context_parallel,
    check_model,
    frame_bounds,
    min_frames_per_rank,
)
from sana2.distributed.initialize import init_weights, write_full_value
from sana2.distributed.parallelize import apply_activation_checkpointing, apply_fsdp
from sana2.models import build_model
from sana2.models.layers import rope_angles

TINY_VIDEO = dict(
    hidden_size=64, depth=2, num_heads=2, linear_head_dim=32, caption_channels=16, model_max_length=5, input_size=8
)
FRAMES, STEPS, BATCH = 6, 3, 2  # 6 frames: cp=4 holds 2, 2, 1, 1 (uneven), cp=2 holds 3, 3


def test_frames_split_into_contiguous_runs_longer_first():
    assert [frame_bounds(6, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert [frame_bounds(31, 2, r) for r in range(2)] == [(0, 16), (16, 31)]
    sizes = [len(part) for part in torch.arange(31).tensor_split(4)]
    assert [stop - start for start, stop in (frame_bounds(31, 4, r) for r in range(4))] == sizes


def test_rotary_angles_of_later_frames_are_the_whole_clips_rows():
    whole = rope_angles(32, (6, 2, 3))
    assert torch.equal(rope_angles(32, (2, 2, 3), frame_offset=4), whole[4 * 6 :])


def test_image_and_softmax_models_are_refused_with_the_setting_to_change():
    from sana2.models.layers import SoftmaxAttention

    with torch.device("meta"):
        image = build_model("SanaMS_debug", attn_type="flash")
        video = build_model("SanaMSVideo", **TINY_VIDEO)
        softmax = build_model("SanaMSVideo", **TINY_VIDEO)
        softmax.blocks[0].attn = SoftmaxAttention(64, 2, qk_norm=False)  # a video variant sana2 may add
    with pytest.raises(ContextParallelError, match="SanaMS is an image model.*context_parallel_degree = 1"):
        check_model(image)
    with pytest.raises(ContextParallelError, match="block 0 .*SoftmaxAttention.*context_parallel_degree = 1"):
        check_model(softmax)
    check_model(video)
    assert min_frames_per_rank(video) == 1  # kernel 3: one frame of halo


def _clips(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(STEPS, BATCH, 16, FRAMES, 8, 8, generator=generator)
    noise = torch.randn(STEPS, BATCH, 16, FRAMES, 8, 8, generator=generator)
    sigma = torch.rand(STEPS, BATCH, generator=generator, dtype=torch.float64)
    captions = torch.randn(STEPS, BATCH, 1, 5, 16, generator=generator)
    mask = torch.ones(BATCH, 5)
    mask[0, 3:] = 0
    return latents, noise, sigma, captions, mask


def _model(checkpointing: bool):
    from sana2.distributed.parallelize import materialize

    with torch.device("meta"):
        model = build_model("SanaMSVideo", **TINY_VIDEO)
    if checkpointing:
        apply_activation_checkpointing(model, "full")
    return model, materialize


def _initialise(model):
    init_weights(model, seed=0)
    with torch.no_grad():  # the released init zeroes t_conv: draw it, so the halo matters from step 1
        for index, block in enumerate(model.blocks):
            weight = block.mlp.t_conv.weight
            full = torch.randn(weight.shape, generator=torch.Generator().manual_seed(index)) * 0.05
            write_full_value(weight, full)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _train(model, cp: ContextParallel | None):
    """STEPS AdamW steps on the shared clips; returns per-step losses, gradients and final weights."""
    from sana2.components.flow import model_timestep, noised

    initial = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    latents, noise, sigma, captions, mask = _clips()
    losses, grads = [], []
    for step in range(STEPS):
        x0, eps = latents[step], noise[step]
        split = cp.split(FRAMES, min_frames=min_frames_per_rank(model)) if cp else None
        if split is not None:
            x0, eps = split.take(x0), split.take(eps)
        x_t, target = noised(x0, eps, sigma[step])
        prediction = model(x_t, model_timestep(sigma[step]), captions[step], mask, drop_ids=torch.tensor([False, True]))
        per_sample = (prediction - target).pow(2).flatten(1).mean(1)
        if split is not None:
            per_sample = cp.whole_sample_loss(per_sample, split)
        loss = per_sample.mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({name: _full(p.grad).clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return losses, grads, weights, initial


def _cp_against_one_rank(rank, world_size, out_file):
    """Every rank trains the whole clip alone (cp=1), then as part of cp=2 groups ({0,1}, {2,3}: both
    train the same clips) and of one cp=4 group, FSDP sharding over the cp ranks; with and without
    activation checkpointing. Rank 0 saves the largest differences."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    meshes = {4: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "cp"))}
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: pairs[rank // 2]}
    results = {}
    for checkpointing in (False, True):
        model, materialize = _model(checkpointing)
        materialize(model, torch.device("cpu"))
        _initialise(model)
        reference = _train(model, None)
        for degree in (2, 4):
            model, materialize = _model(checkpointing)
            cp = ContextParallel(groups[degree])
            apply_context_parallel(model, cp)
            mesh = meshes[degree] if degree == 4 else meshes[2]["cp"]
            apply_fsdp(model, mesh, param_dtype=torch.float32)
            materialize(model, torch.device("cpu"))
            _initialise(model)
            losses, grads, weights, _ = _train(model, cp)
            results[(degree, checkpointing)] = {
                "loss": max(abs(a - b) for a, b in zip(losses, reference[0])),
                "grad": max((g[k] - r[k]).abs().max().item() for g, r in zip(grads, reference[1]) for k in r),
                "weight": max((weights[k] - reference[2][k]).abs().max().item() for k in weights),
                "moved": max((reference[2][k] - reference[3][k]).abs().max().item() for k in weights),
                "t_conv_grad": reference[1][0]["blocks.0.mlp.t_conv.weight"].abs().max().item(),
            }
    if rank == 0:
        torch.save(results, out_file)


@pytest.mark.slow
def test_cp2_and_cp4_match_one_rank_in_loss_gradients_and_weights(tmp_path):
    run_distributed(_cp_against_one_rank, 4, tmp_path / "cp.pt")
    results = torch.load(tmp_path / "cp.pt")
    assert set(results) == {(d, ac) for d in (2, 4) for ac in (False, True)}
    for case, diff in results.items():
        assert diff["t_conv_grad"] > 1e-4, case  # the temporal conv (and its halo) carries gradient
        assert diff["moved"] > 1e-3, case  # the steps changed the weights
        for what in ("loss", "grad", "weight"):
            assert diff[what] < 1e-5, (case, what, diff)


# -- the memory plan -------------------------------------------------------------------------------
VIDEO_CONFIG = "train_configs/sana_video_2000m_480p.toml"


def _video_plan(degree: int, memory_gib=None, *overrides):
    from pathlib import Path

    from sana2.config import load_config
    from sana2.plan import make_memory_plan

    root = Path(__file__).resolve().parents[1]
    config = load_config(
        root / VIDEO_CONFIG, [f"--parallelism.context_parallel_degree={degree}", "--activation_checkpoint.mode=none"]
    )
    return make_memory_plan(config, 8, memory_gib=memory_gib, resolution=(720, 1280), frames=121)


def test_plan_divides_a_clips_activations_over_cp_ranks_and_counts_what_cp_sends():
    one, two, four = (_video_plan(degree).estimate for degree in (1, 2, 4))
    assert (one.setup.rank_tokens, two.setup.rank_tokens, four.setup.rank_tokens) == (111_600, 57_600, 28_800)
    assert one.setup.global_batch == 8 and two.setup.global_batch == 4  # data is split over dp ranks only
    for split, degree in ((two, 2), (four, 4)):
        ratio = split.sizes["activations"] / one.sizes["activations"]
        assert abs(ratio - split.setup.rank_tokens / 111_600) < 0.02, (degree, ratio)
        assert split.sizes["parameters"] == one.sizes["parameters"]  # FSDP over dp_shard x cp: still 8
    assert one.context_parallel == 0 and two.context_parallel > 0
    # the halos dominate: 2 passes x 20 blocks x one 16-frame edge (D x 45 x 80 bf16) for cp=2
    assert abs(two.context_parallel - 2 * 20 * 2240 * 3600 * 2 - 40 * 20 * (112**2 + 112) * 4) < 1e6


def test_plan_suggests_cp_degrees_smallest_first_when_a_clip_does_not_fit():
    plan = _video_plan(1, 200)
    changes = [s.change for s in plan.suggestions]
    cp_changes = [c for c in changes if "context_parallel_degree" in c]
    assert [c.split()[0] for c in cp_changes] == [
        "--parallelism.context_parallel_degree=4",
        "--parallelism.context_parallel_degree=8",
    ]
    assert all(s.estimate.peak <= 200 * 2**30 for s in plan.suggestions)


def test_plan_refuses_cp_for_an_image_model():
    from sana2.config import ConfigError, load_config
    from sana2.plan import make_memory_plan

    config = load_config(None, ["--parallelism.context_parallel_degree=2"])
    with pytest.raises(ConfigError, match="context_parallel_degree = 2: .*image model"):
        make_memory_plan(config, 2, device="cpu")
