"""Context parallelism: a clip's frames split over cp ranks give one rank's loss, gradients and weights."""

import pytest
import torch
from dist_utils import run_distributed
from train_utils import TINY_VIDEO_MODEL, VIDEO_VALIDATION, assert_same_run, train_and_record, write_video_features

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


def _train(model, cp: ContextParallel | None, data=(0, 1), save_after=None, resume_from=None, folder=None):
    """AdamW steps on the shared clips; returns per-step losses, gradients and final weights.

    `data` = (data rank, data ranks): this rank's cp group trains every data-ranks-th clip of a step.

    `save_after` steps, model and optimizer go to a DCP checkpoint in `folder`; `resume_from` steps
    loads that checkpoint first and trains the remaining steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from sana2.components.flow import Draw, FlowMatching

    initial = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if resume_from is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    latents, noise, sigma, captions, mask = _clips()
    losses, grads = [], []
    flow = FlowMatching(seed=0)
    mine = slice(data[0], None, data[1])  # data is split over the data-parallel ranks only
    for step in range(resume_from or 0, STEPS):
        batch = {"latents": latents[step][mine], "caption_embeds": captions[step][mine], "caption_mask": mask[mine]}
        draw = Draw(sigma[step][mine], noise[step][mine], torch.tensor([False, True])[mine])
        per_sample = flow.loss(model, batch, draw, cp)  # the trainer's loss, split when cp is given
        loss = per_sample.mean()
        loss.backward()
        reported = loss.detach().clone()
        if data[1] > 1:  # the global mean: every rank of a cp group holds its clips' loss
            torch.distributed.all_reduce(reported)
            reported /= torch.distributed.get_world_size()
        losses.append(reported.item())
        grads.append({name: _full(p.grad).clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        if save_after == step + 1:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    weights = {name: _full(p.detach()).clone() for name, p in model.named_parameters()}
    return losses, grads, weights, initial


def _whole_clip_difference(model, cp, reference_model) -> float:
    """Sampling's forward: the split model on whole clips (frames gathered) against the one-rank model
    holding the same weights."""
    from sana2.distributed.context_parallel import WholeClipForward

    latents, _, sigma, captions, mask = _clips(seed=1)
    with torch.no_grad():
        model.eval(), reference_model.eval()
        reference_model.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
        whole = WholeClipForward(model, cp)(latents[0], sigma[0] * 1000, captions[0], mask)
        expected = reference_model(latents[0], sigma[0] * 1000, captions[0], mask)
        model.train(), reference_model.train()
    assert whole.shape == expected.shape
    return (whole - expected).abs().max().item()


def _cp_model(degree, checkpointing, groups, meshes):
    model, materialize = _model(checkpointing)
    cp = ContextParallel(groups[degree])
    apply_context_parallel(model, cp)
    apply_fsdp(model, meshes[degree], param_dtype=torch.float32)  # cp=2: HSDP, replicas over the pairs
    materialize(model, torch.device("cpu"))
    _initialise(model)
    return model, cp


def _cp_against_one_rank(rank, world_size, out_file):
    """Every rank trains both clips of each step alone (cp=1); then in two cp=2 groups ({0,1}, {2,3}), a
    clip each, HSDP (shards over a pair's cp ranks, replicas across the pairs); then in one cp=4 group
    training both clips, FSDP over the four ranks; with and without
    activation checkpointing; then cp=4's DCP checkpoint of STEPS - 1 steps resumes at cp=2 for the last
    step. Rank 0 saves the largest differences."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    meshes = {4: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "cp"))}
    groups = {4: dist.new_group([0, 1, 2, 3]), 2: pairs[rank // 2]}
    data = {4: (0, 1), 2: (rank // 2, 2)}  # cp=2: two data-parallel cp groups, a clip each
    results = {}
    for checkpointing in (False, True):
        model, materialize = _model(checkpointing)
        materialize(model, torch.device("cpu"))
        _initialise(model)
        reference = _train(model, None)
        reference_model = model
        if not checkpointing:
            last_reference = reference
        for degree in (2, 4):
            model, cp = _cp_model(degree, checkpointing, groups, meshes)
            save = dict(save_after=STEPS - 1, folder=str(out_file.parent / "cp4")) if degree == 4 else {}
            losses, grads, weights, _ = _train(model, cp, data[degree], **save)
            forward = _whole_clip_difference(model, cp, reference_model) if not checkpointing else 0.0
            results[(degree, checkpointing)] = {
                "loss": max(abs(a - b) for a, b in zip(losses, reference[0])),
                "grad": max((g[k] - r[k]).abs().max().item() for g, r in zip(grads, reference[1]) for k in r),
                "weight": max((weights[k] - reference[2][k]).abs().max().item() for k in weights),
                "moved": max((reference[2][k] - reference[3][k]).abs().max().item() for k in weights),
                "t_conv_grad": reference[1][0]["blocks.0.mlp.t_conv.weight"].abs().max().item(),
                "forward": forward,
            }
    # resume at another cp degree: cp=4's checkpoint after STEPS - 1 steps, the last step at cp=2
    model, cp = _cp_model(2, False, groups, meshes)
    resumed = dict(resume_from=STEPS - 1, folder=str(out_file.parent / "cp4"))
    losses, _, weights, _ = _train(model, cp, data[2], **resumed)
    results["resumed"] = {"loss": abs(losses[0] - last_reference[0][-1])}
    results["resumed"]["weight"] = max((weights[k] - last_reference[2][k]).abs().max().item() for k in weights)
    if rank == 0:
        torch.save(results, out_file)


@pytest.mark.slow
def test_cp2_and_cp4_match_one_rank_in_loss_gradients_and_weights_and_resume_across_degrees(tmp_path):
    run_distributed(_cp_against_one_rank, 4, tmp_path / "cp.pt")
    results = torch.load(tmp_path / "cp.pt")
    resumed = results.pop("resumed")  # cp=4's checkpoint resumed at cp=2: DCP holds no cp state
    assert resumed["loss"] < 1e-5 and resumed["weight"] < 1e-5, resumed
    assert set(results) == {(d, ac) for d in (2, 4) for ac in (False, True)}
    for case, diff in results.items():
        assert diff["t_conv_grad"] > 1e-4, case  # the temporal conv (and its halo) carries gradient
        assert diff["moved"] > 1e-3, case  # the steps changed the weights
        for what in ("loss", "grad", "weight", "forward"):
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


def test_parallelize_refuses_cp_for_an_image_model_and_with_compile():
    from types import SimpleNamespace

    from sana2.config import load_config
    from sana2.distributed.parallel_dims import ParallelDims
    from sana2.distributed.parallelize import ParallelizeError, parallelize_sana

    def parallelize(model, *overrides):
        config = load_config(None, list(overrides))
        sections = (config.parallelism, config.training, config.activation_checkpoint, config.compile)
        # refused before the mesh (built on first use) or any of the cp group's collectives is needed
        parallelize_sana(model, ParallelDims(1, 1, 2), *sections, SimpleNamespace(degree=2))

    with torch.device("meta"):
        image = build_model("SanaMS_debug")
        video = build_model("SanaMSVideo", **TINY_VIDEO)
    with pytest.raises(ParallelizeError, match="^parallelism.context_parallel_degree = 2: .*SanaMS is an image model"):
        parallelize(image)
    with pytest.raises(ParallelizeError, match="compile.enable = true: turn one off"):
        parallelize(video, "--compile.enable=true")


# -- through the trainer ---------------------------------------------------------------------------
def _train_recording_splits(rank, world_size, dump, out_file, *overrides):
    """train_utils.train_and_record's run, recording the frames each rank's splits took."""
    import json

    seen, split = set(), ContextParallel.split

    def recording(self, *args, **kwargs):
        result = split(self, *args, **kwargs)
        seen.add((result.start, result.stop, result.total))
        return result

    ContextParallel.split = recording
    try:
        train_and_record(rank, world_size, dump, out_file, *overrides)
    finally:
        ContextParallel.split = split
    out_file.with_suffix(f".rank{rank}.json").write_text(json.dumps(sorted(seen)))


@pytest.mark.slow
def test_the_trainer_with_cp_matches_one_rank_alone_and_under_hsdp(tmp_path):
    """16 three-frame clips, global batch 16: one rank; cp=2 on 2 ranks (frames 2 + 1, FSDP over the
    pair); HSDP with 2 replicas x cp=2 on 4 ranks (each cp group a data rank). Validation samples
    through the split model."""
    import json

    write_video_features(tmp_path / "video")
    video = [
        *TINY_VIDEO_MODEL,
        f"--data.path={tmp_path / 'video'}",
        *VIDEO_VALIDATION,
    ]
    runs = {
        "one": (1, []),
        "cp2": (2, ["--parallelism.context_parallel_degree=2"]),
        "hsdp_cp2": (4, ["--parallelism.context_parallel_degree=2", "--parallelism.data_parallel_replicate_degree=2"]),
    }
    for name, (world, extra) in runs.items():
        run_distributed(_train_recording_splits, world, tmp_path / name, tmp_path / f"{name}.pt", *video, *extra)
    splits = {
        name: [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(runs[name][0])]
        for name in runs
    }
    assert splits["one"] == [[]]  # no cp: no split
    assert splits["cp2"] == [[[0, 2, 3]], [[2, 3, 3]]]  # each rank of the pair its own frames
    assert splits["hsdp_cp2"] == [[[0, 2, 3]], [[2, 3, 3]]] * 2
    reference = torch.load(tmp_path / "one.pt")
    for name in ("cp2", "hsdp_cp2"):
        assert_same_run(torch.load(tmp_path / f"{name}.pt"), reference, 1e-5, 1e-5)


def _video_run(rank, world_size, dump, out_file, resume_from, *overrides):
    """Train the video features to step 2 and save (or resume from `resume_from`), then one more step."""
    from train_utils import full_model_state, run_steps, tiny_config

    from sana2.train import Trainer

    run = ["--checkpoint.enable=true", "--checkpoint.interval=1000", "--training.global_batch_size=16"]
    if resume_from:
        run.append(f"--checkpoint.resume_from={resume_from}")
    trainer = Trainer(tiny_config(dump, *run, *overrides))
    if not resume_from:
        run_steps(trainer, 2)
        trainer.save_checkpoint(final=True)
    # copied: on one process the full tensors are the parameters themselves, which the next step changes
    state = {key: value.clone() for key, value in full_model_state(trainer.model).items()}
    next_loss = run_steps(trainer, 1)[0]
    if rank == 0:
        torch.save({"step": trainer.step, "state": state, "next_loss": next_loss}, out_file)


@pytest.mark.slow
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_exactly(tmp_path):
    from checkpoint_factory import step_folder

    write_video_features(tmp_path / "video")
    video = [*TINY_VIDEO_MODEL, f"--data.path={tmp_path / 'video'}"]
    run_distributed(
        _video_run, 2, tmp_path / "cp2", tmp_path / "cp2.pt", "", *video, "--parallelism.context_parallel_degree=2"
    )
    source = str(step_folder(tmp_path / "cp2", 2))
    run_distributed(_video_run, 1, tmp_path / "cp1", tmp_path / "cp1.pt", source, *video)
    saved, resumed = torch.load(tmp_path / "cp2.pt"), torch.load(tmp_path / "cp1.pt")
    assert resumed["step"] == saved["step"] == 3
    for key, value in saved["state"].items():
        torch.testing.assert_close(resumed["state"][key], value, atol=0, rtol=0, msg=key)  # DCP: bit-exact
    assert abs(resumed["next_loss"] - saved["next_loss"]) < 1e-5  # the next step: cp=1 computes it whole
