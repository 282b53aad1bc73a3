"""FSDP2 training end to end: equivalence to one process, HSDP, 1/N storage, config errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from shard_damage import overwrite_tensor_bytes
from torch.distributed.tensor import DTensor
from train_utils import (
    STEPS,
    TINY,
    TINY_MODEL,
    TINY_VIDEO_MODEL,
    VIDEO_VALIDATION,
    assert_same_run,
    full_model_state,
    tiny_config,
    train_and_record,
    write_video_features,
)

from sana2.data.digits import build_digits_dataset
from sana2.distributed.initialize import init_weights
from sana2.models import build_model


@pytest.fixture(scope="module")
def single_process_fp32(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run_distributed(train_and_record, 1, tmp / "run", tmp / "result.pt")
    return torch.load(tmp / "result.pt")


@pytest.mark.slow
def test_two_rank_fsdp_matches_single_process_in_fp32(tmp_path, single_process_fp32):
    run_distributed(train_and_record, 2, tmp_path / "run", tmp_path / "result.pt")
    result = torch.load(tmp_path / "result.pt")
    # Same samples, noise and init; only the reduction order differs (two partial sums averaged
    # by reduce-scatter instead of one sum), which moves fp32 results by a few ulps per step.
    assert_same_run(result, single_process_fp32, loss_atol=1e-5, param_atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [
        ["--parallelism.reshard_after_forward=false"],
        ["--parallelism.cpu_offload=true"],
        ["--activation_checkpoint.mode=full"],
        ["--activation_checkpoint.mode=selective"],
    ],
    ids=lambda v: v[0].split("--")[1],
)
def test_memory_options_do_not_change_the_numbers(tmp_path, single_process_fp32, variant):
    run_distributed(train_and_record, 2, tmp_path / "run", tmp_path / "result.pt", *variant)
    assert_same_run(torch.load(tmp_path / "result.pt"), single_process_fp32, loss_atol=1e-5, param_atol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_reduce_scatters_once_per_step(tmp_path, single_process_fp32):
    run_distributed(
        train_and_record, 2, tmp_path / "run", tmp_path / "result.pt", "--training.gradient_accumulation_steps=2"
    )
    result = torch.load(tmp_path / "result.pt")
    # 2 blocks + the root are FSDP units: one reduce-scatter each per step, not per micro-batch
    assert result["reduce_scatters_per_step"] == 3
    # 2 micro-batches of 4 per rank see the same 16 samples per step as 1 process with 16
    assert_same_run(result, single_process_fp32, loss_atol=1e-5, param_atol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path, single_process_fp32):
    run_distributed(train_and_record, 1, tmp_path / "run", tmp_path / "result.pt", "--compile.enable=true")
    # inductor fuses kernels and may reorder fp32 sums: equal to a few ulps per step, not bitwise
    assert_same_run(torch.load(tmp_path / "result.pt"), single_process_fp32, loss_atol=1e-4, param_atol=1e-4)


@pytest.mark.slow
def test_bf16_params_with_fp32_reduce_stay_close(tmp_path, single_process_fp32):
    run_distributed(
        train_and_record, 2, tmp_path / "run", tmp_path / "result.pt", "--training.mixed_precision_param=bfloat16"
    )
    result = torch.load(tmp_path / "result.pt")
    # bf16 keeps 8 mantissa bits (relative error ~4e-3 per op); the loss of ~1 stays within 2%.
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(single_process_fp32["losses"]), atol=0.02, rtol=0
    )


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_matches_fsdp_on_4_ranks(tmp_path):
    run_distributed(train_and_record, 4, tmp_path / "fsdp", tmp_path / "fsdp.pt")
    run_distributed(
        train_and_record, 4, tmp_path / "hsdp", tmp_path / "hsdp.pt", "--parallelism.data_parallel_replicate_degree=2"
    )
    assert_same_run(torch.load(tmp_path / "hsdp.pt"), torch.load(tmp_path / "fsdp.pt"), 1e-5, 1e-5)


def _check_storage_is_sharded(rank, world_size, dump, out_file):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, "--training.local_batch_size=4"))
    model = trainer.model
    # one forward/backward, gradients kept, then an optimizer step to create its state
    batch = trainer.loader.next_step()[0]
    draw = trainer.flow.draw(1, batch["indices"], tuple(batch["latents"].shape[1:]))
    out = model(
        batch["latents"] + draw.noise * 0.5, (draw.sigma * 1000).long(), batch["caption_embeds"], batch["caption_mask"]
    )
    out.square().mean().backward()
    local = {"param": 0, "grad": 0, "exp_avg": 0, "exp_avg_sq": 0}
    full = 0
    for param in model.parameters():
        assert isinstance(param, DTensor) and isinstance(param.grad, DTensor)
        assert param.to_local().shape == param.grad.to_local().shape
        local["param"] += param.to_local().numel()
        local["grad"] += param.grad.to_local().numel()
        full += param.numel()
    trainer.optimizer.step()
    for param in model.parameters():
        state = trainer.optimizer.state[param]
        local["exp_avg"] += state["exp_avg"].to_local().numel()
        local["exp_avg_sq"] += state["exp_avg_sq"].to_local().numel()
    torch.save(
        {"local": local, "full": full, "rows": sum(p.shape[0] for p in model.parameters())}, f"{out_file}.{rank}"
    )


@pytest.mark.slow
def test_each_rank_stores_one_nth_of_params_grads_and_optimizer_state(tmp_path):
    run_distributed(_check_storage_is_sharded, 2, tmp_path / "run", tmp_path / "storage")
    results = [torch.load(f"{tmp_path / 'storage'}.{rank}") for rank in range(2)]
    full = results[0]["full"]
    for rank, result in enumerate(results):
        for kind, count in result["local"].items():
            # dim-0 chunks: a rank holds at most one extra row of each tensor (uneven split)
            assert full / 2 - full * 0.05 <= count <= full / 2 + full * 0.05, (rank, kind, count, full)
    assert sum(r["local"]["param"] for r in results) == full  # nothing duplicated, nothing lost


BAD_INPUTS = [
    (["--foo.bar=1"], "unknown section [foo]"),
    (["--training.stepz=3"], "unknown key training.stepz"),
    (["--training.steps=many"], "training.steps: expected int"),
    (["--optimizer.name=sgd"], "optimizer.name = 'sgd' is not allowed"),
    (
        ["--model.name=SanaMS_9000M"],
        "command-line override --model.name=SanaMS_9000M: [model] model.name = 'SanaMS_9000M': unknown model",
    ),
    # a flag's error names the flag, the key and the path, not the TOML file
    (["--data.vae=/models/vae"], "command-line override --data.vae=/models/vae: data.vae is now encoding.vae"),
    (
        ["--data.path=/nonexistent/features"],
        "command-line override --data.path=/nonexistent/features: data.path = '/nonexistent/features': no such "
        'file or folder (expected a feature dataset folder (sana2-prepare\'s --output), or "digits")',
    ),
    (
        ["--checkpoint.initial_load_path=/nonexistent/model.pt"],
        "command-line override --checkpoint.initial_load_path=/nonexistent/model.pt: checkpoint.initial_load_path "
        "= '/nonexistent/model.pt': no such file or folder",
    ),
    (["--model.depthh=3"], "depthh"),
    (["--parallelism.data_parallel_shard_degree=2"], "must equal the world size 1"),
    (
        ["--training.global_batch_size=10", "--training.gradient_accumulation_steps=3"],
        "global_batch_size = 10 is not divisible",
    ),
    # caught while the data is built (the trainer adds where the setting came from)
    (
        ["--data.mode=online", '--data.inputs=["no-such-inputs"]', "--encoding.vae=none"],
        "[data] online, [encoding]: input no-such-inputs: expected an image folder",
    ),
    # caught before launch: the VAE folder is read before any data is built
    (
        ["--validation.enable=true", "--validation.vae=no-such-vae"],
        "command-line override --validation.vae=no-such-vae: validation.vae = 'no-such-vae': the validation VAE cannot"
        " be loaded: VAE 'no-such-vae': no config.json there",
    ),
    # caught once the data is open: the digits set is built first (seconds)
    pytest.param(
        ["--model.name=SanaMS_debug"],
        "command-line override --model.name=SanaMS_debug: [model] does not fit [data] digits: model in_channels=4",
        id="another model than the data's",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        ["--model.in_channels=3"],
        # the flag is named, not the TOML file
        "command-line override --model.in_channels=3: [model] does not fit [data] digits: model in_channels=3 but"
        " the data's latents have 1 channels",
        id="in_channels=3 but the data's latents have 1 channels",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(
    "overrides, message", [pytest.param(*case, id=case[1]) if type(case) is tuple else case for case in BAD_INPUTS]
)
def test_bad_config_stops_with_a_message_naming_the_key(tmp_path, overrides, message, capfd):
    from sana2.train import main

    assert main([*TINY, f"--job.dump_folder={tmp_path}", *overrides]) == 2
    assert message in capfd.readouterr().err


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_encoders_the_run_cannot_use_stop_it_before_any_worker_starts(tmp_path, capfd):
    """A text encoder folder that does not exist (refused with validation off too: the checkpoints name it for
    sampling) and a validation VAE of other latent channels than the model's: exit 2 before the first step,
    from the launcher's check (sana2.preflight) and from the trainer itself; the user's folders stay as they were."""
    from encoder_factory import save_tiny_dc_ae

    from sana2.preflight import check_main
    from sana2.train import main

    vae = save_tiny_dc_ae(tmp_path / "dc-ae")  # 4 latent channels; SanaMS_digits takes 1
    kept = _tree(vae)
    missing = tmp_path / "checkpoints" / "gemma-2-2b-it"
    base = [*TINY, f"--job.dump_folder={tmp_path}/run"]
    for run in (check_main, main):
        assert run([*base, f"--encoding.text_encoder={missing}"]) == 2
        err = capfd.readouterr().err
        assert f"command-line override --encoding.text_encoder={missing}: encoding.text_encoder: " in err
        assert f"text encoder '{missing}': no such directory (expected 'tiny-t5' or a local" in err
        assert run([*base, "--validation.enable=true", f"--validation.vae={vae}"]) == 2
        err = capfd.readouterr().err
        assert f"--model.name=SanaMS_digits, --validation.vae={vae}: validation.vae = '{vae}'" in err
        assert "has 4 latent channels; model.name = 'SanaMS_digits' takes 1 (model.in_channels)" in err
        assert "Traceback" not in err and _tree(vae) == kept
    # what a run may name: tiny-t5, a folder that exists, a VAE of the model's channels, or none
    debug = ["--model.name=SanaMS_debug", f"--job.dump_folder={tmp_path}/run"]
    assert check_main([*debug, f"--encoding.text_encoder={vae}", f"--validation.vae={vae}"]) == 0
    assert check_main([*TINY, "--validation.enable=true", "--validation.vae=none"]) == 0
    assert check_main([*base, f"--validation.vae={tmp_path}/nowhere"]) == 0  # validation off: not loaded
    assert check_main([*base, "--validation.enable=true", f"--validation.vae={tmp_path}/nowhere"]) == 2
    assert f"validation.vae = '{tmp_path}/nowhere': the validation VAE cannot be loaded: VAE '{tmp_path}/" in (
        capfd.readouterr().err
    )


@pytest.mark.slow
def test_garbage_inside_a_feature_shard_stops_before_its_step_naming_the_shard(tmp_path, capfd):
    """4 KiB overwritten inside a shard's tensor: one message naming the shard and the tensor, exit code 2,
    before the step that would have read it (not a skipped NaN step that names no data)."""
    from sana2.train import main

    train_dir, val_dir = build_digits_dataset(tmp_path / "data")
    data = [f"--data.path={train_dir}", f"--data.val_path={val_dir}", "--metrics.log_freq=1", "--training.steps=3"]
    # the held-out set's batches are read at start-up: a damaged one stops the run there
    overwrite_tensor_bytes(val_dir / "shard_00000.safetensors", "caption_embeds")
    validation = ["--validation.enable=true", "--validation.at_start=false", "--validation.num_loss_samples=8"]
    assert main([*TINY, f"--job.dump_folder={tmp_path / 'validated'}", *data, *validation]) == 2
    err = capfd.readouterr().err
    assert f"{val_dir / 'shard_00000.safetensors'}: tensor 'caption_embeds' is corrupt" in err
    assert "step 1/3" not in err and "Traceback" not in err
    # a training shard: read at the step that draws it
    overwrite_tensor_bytes(train_dir / "shard_00001.safetensors", "caption_embeds")
    assert main([*TINY, f"--job.dump_folder={tmp_path / 'run'}", *data]) == 2
    err = capfd.readouterr().err
    assert f"{train_dir / 'shard_00001.safetensors'}: tensor 'caption_embeds' is corrupt" in err
    assert "step 1/3" not in err and "Traceback" not in err and "non-finite" not in err


@pytest.mark.slow
def test_bad_config_file_exits_nonzero_without_traceback(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[training]\nsteps = 'ten'\n")
    proc = subprocess.run(
        [sys.executable, "-m", "sana2.train", str(config)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert f"{config}: training.steps: expected int, got str 'ten'" in proc.stderr
    assert "Traceback" not in proc.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "sana2.train", str(tmp_path / "nope.toml")], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "nope.toml does not exist" in missing.stderr


def _train_with_poisoned_batches(rank, world_size, dump, out_file, poisoned_steps, limit):
    from sana2.components.train_state import NonFiniteError
    from sana2.train import Trainer

    trainer = Trainer(
        tiny_config(dump, "--training.local_batch_size=4", f"--training.max_consecutive_nonfinite={limit}")
    )
    real_next_step = trainer.loader.next_step

    def next_step():
        batches = real_next_step()
        if trainer.step + 1 in poisoned_steps and rank == 1:  # one rank's data goes bad
            batches[0]["latents"][0, 0, 0, 0] = float("nan")
        return batches

    trainer.loader.next_step = next_step
    record = {"changed": [], "error": None}
    try:
        for _ in range(6):
            before = full_model_state(trainer.model)
            trainer.train_step()
            after = full_model_state(trainer.model)
            record["changed"].append(any(not torch.equal(before[k], after[k]) for k in before))
    except NonFiniteError as error:
        record["error"] = str(error)
    record["skipped"] = trainer.train_state.skipped_steps
    if rank == 0:
        torch.save(record, out_file)


@pytest.mark.slow
def test_non_finite_steps_are_skipped_counted_and_eventually_stop_the_run(tmp_path):
    run_distributed(_train_with_poisoned_batches, 2, tmp_path / "a", tmp_path / "a.pt", {2, 4}, 3)
    record = torch.load(tmp_path / "a.pt")
    assert record["changed"] == [True, False, True, False, True, True]  # both ranks skipped together
    assert record["skipped"] == 2 and record["error"] is None
    run_distributed(_train_with_poisoned_batches, 2, tmp_path / "b", tmp_path / "b.pt", {2, 3, 4}, 3)
    record = torch.load(tmp_path / "b.pt")
    assert record["skipped"] == 3
    assert "3 consecutive steps had a non-finite loss" in record["error"]
    assert "training.max_consecutive_nonfinite = 3" in record["error"]


@pytest.mark.slow
def test_came_sharded_training_matches_single_process(tmp_path):
    came = [
        "--optimizer.name=came",
        "--optimizer.betas=[0.9, 0.999, 0.9999]",
        "--optimizer.eps=[1e-30, 1e-16]",
        "--optimizer.lr=1e-4",
    ]
    run_distributed(train_and_record, 1, tmp_path / "one", tmp_path / "one.pt", *came)
    run_distributed(train_and_record, 2, tmp_path / "two", tmp_path / "two.pt", *came)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    # CAME scales every update to about +-lr whatever the gradient's size, so an entry whose
    # gradient is near zero (its sign set by summation order, e.g. the key half of
    # cross_attn.kv_linear.bias, whose true gradient is exactly 0) may step the other way in the
    # other run: at most 2 lr per step apart. Nearly all entries agree to fp32 rounding.
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), atol=1e-4, rtol=0)
    lr, within, total = 1e-4, 0, 0
    for key, value in one["state"].items():
        difference = (two["state"][key] - value).abs()
        assert difference.max() <= 2 * STEPS * lr, key
        within += (difference <= 1e-5).sum().item()
        total += difference.numel()
    assert within / total > 0.99
    config = tiny_config(tmp_path)
    initial = build_model(config.model.name, **config.model.overrides)
    init_weights(initial, seed=config.training.seed)
    assert max((one["state"][k] - v).abs().max().item() for k, v in initial.state_dict().items()) > 1e-5


@pytest.fixture(scope="module")
def video_fp32_runs(tmp_path_factory) -> tuple[Path, dict, dict]:
    """The video model's fp32 runs on 1 and 2 ranks, validation (sampling) included: (features, 1 rank, 2 ranks).
    Two tests read them: the trainer takes the video model as it takes the image one, and bf16 stays close."""
    tmp = tmp_path_factory.mktemp("video")
    write_video_features(tmp / "video")
    video = [*TINY_VIDEO_MODEL, f"--data.path={tmp / 'video'}", *VIDEO_VALIDATION]
    run_distributed(train_and_record, 1, tmp / "one", tmp / "one.pt", *video)
    run_distributed(train_and_record, 2, tmp / "two", tmp / "two.pt", *video)
    return tmp / "video", torch.load(tmp / "one.pt"), torch.load(tmp / "two.pt")


@pytest.mark.slow
def test_the_video_model_trains_through_the_same_trainer(video_fp32_runs):
    _, one, two = video_fp32_runs
    assert_same_run(two, one, 1e-5, 1e-5)


@pytest.mark.slow
def test_the_video_model_trains_in_bf16_with_its_rotary_angles_kept_in_float64(tmp_path, video_fp32_runs):
    """FSDP must not cast the blocks' float64 rotary angles to bf16 (torch.polar rejects them, and
    bf16 angles would be wrong by radians at large positions)."""
    features, _, fp32 = video_fp32_runs
    video = [
        *TINY_VIDEO_MODEL,
        f"--data.path={features}",
        *VIDEO_VALIDATION,
        "--training.mixed_precision_param=bfloat16",
    ]
    run_distributed(train_and_record, 2, tmp_path / "bf16", tmp_path / "bf16.pt", *video)
    bf16 = torch.load(tmp_path / "bf16.pt")
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]), atol=0.02, rtol=0)


@pytest.mark.slow
def test_run_train_sh_rejects_a_bad_config_before_launching_workers(tmp_path):
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [str(root / "run_train.sh"), f"--job.dump_folder={tmp_path}", "--parallelism.data_parallel_shard_degree=3"],
        env={**os.environ, "NGPU": "2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "context_parallel_degree = 1 x 3 x 1 must equal the world size 2" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def _initial_full_state(rank, world_size, dump, out_file, *overrides):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *overrides))
    state = full_model_state(trainer.model)
    if rank == 0:
        torch.save(state, out_file)


@pytest.mark.slow
def test_initialisation_is_identical_at_1_2_and_4_ranks(tmp_path):
    for world_size in (1, 2, 4):
        run_distributed(_initial_full_state, world_size, tmp_path / f"run{world_size}", tmp_path / f"{world_size}.pt")
    one = torch.load(tmp_path / "1.pt")
    reference = build_model("SanaMS_digits", **TINY_MODEL)
    init_weights(reference, seed=3)  # the unsharded model, same seed as tiny_config
    for world_size in (2, 4):
        sharded = torch.load(tmp_path / f"{world_size}.pt")
        for key, value in one.items():
            assert torch.equal(sharded[key], value), (world_size, key)
    for key, value in reference.state_dict().items():
        assert torch.equal(one[key], value), key
