"""The TOML config: shipped configs load, overrides parse as TOML literals, resolved config round-trips."""

import re
from pathlib import Path

import pytest

from sana2.config import BatchSizes, ConfigError, load_config, resolve_batch
from sana2.distributed.parallel_dims import ParallelDims

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_load_and_their_resolved_form_reproduces_them(path, tmp_path):
    config = load_config(path)
    resolved = tmp_path / "config.toml"
    resolved.write_text(config.to_toml())
    assert load_config(resolved).to_dict() == config.to_dict()


def test_shipped_configs_cover_the_reference_trainings():
    names = {load_config(p).model.name for p in CONFIGS}
    assert {"SanaMS_600M_P1_D28", "SanaMS_1600M_P1_D20", "SanaMS_1600M_P1_D20_sana1.5", "SanaMS_digits"} <= names


def test_overrides_are_typed_toml_literals():
    config = load_config(
        None,
        [
            "--training.steps=7",
            "--optimizer.lr=3e-4",
            "--optimizer.betas=[0.8, 0.9]",
            "--parallelism.cpu_offload=true",
            "--job.description=two words",
            "--model.qk_norm=true",
            "--training.max_norm=1",
        ],
    )
    assert config.training.steps == 7 and config.optimizer.lr == 3e-4
    assert config.optimizer.betas == [0.8, 0.9] and config.parallelism.cpu_offload is True
    assert config.job.description == "two words" and config.model.overrides == {"qk_norm": True}
    assert isinstance(config.training.max_norm, float)  # ints are accepted where floats are expected


def test_override_wins_over_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nsteps = 5\nseed = 1\n")
    config = load_config(path, ["--training.steps=9"])
    assert (config.training.steps, config.training.seed) == (9, 1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nsteps = 0\n", "training.steps must be > 0"),
        ("[training]\ncaption_dropout = 1.5\n", "training.caption_dropout = 1.5 must be in [0, 1)"),
        ("[lr_scheduler]\nwarmup_steps = 50\ndecay_type = 'cosine'\n[training]\nsteps = 10\n", "must exceed"),
        ("[optimizer]\nname = 'came'\n", "optimizer.betas must have 3 values"),
        ("[training\nsteps = 1\n", "is not valid TOML"),
        ("training = 3\n", "[training] must be a table"),
        ("[optimizer]\nbetas = [0.9, 1.5]\n", "optimizer.betas must each be in [0, 1)"),
        ("[optimizer]\nlr = 0\n", "optimizer.lr must be > 0"),
        ("[validation]\nprompts = []\n", "validation.prompts must be a non-empty list of strings"),
        ("[validation]\nloss_sigmas = [0.5, 2]\n", "validation.loss_sigmas must each be in [0, 1]"),
        ("[training]\nmixed_precision_param = 'float16'\n", "mixed_precision_param = 'float16' is not allowed"),
    ],
)
def test_impossible_values_name_the_key_and_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_malformed_override_is_an_error():
    with pytest.raises(ConfigError, match="expected --section.key=value"):
        load_config(None, ["--steps=3"])


def test_world_size_resolves_the_mesh_and_the_local_batch():
    config = load_config(
        None,
        [
            "--parallelism.data_parallel_replicate_degree=2",
            "--training.global_batch_size=64",
            "--training.gradient_accumulation_steps=2",
        ],
    )
    before = config.to_dict()
    dims = ParallelDims.from_config(config, 4)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 2)
    assert resolve_batch(config, dims.dp_size) == BatchSizes(local=8, image_local=4)
    assert config.to_dict() == before  # the values are returned; the config keeps what was written
    with pytest.raises(ConfigError, match="does not divide the world size 3"):
        ParallelDims.from_config(load_config(None, ["--parallelism.data_parallel_replicate_degree=2"]), 3)
    with pytest.raises(ConfigError, match="global_batch_size = 64 is not divisible by data-parallel ranks .* = 6"):
        resolve_batch(config, 3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--lr_scheduler.warmup_steps=-1"], "lr_scheduler.warmup_steps must be >= 0"),
        (["--lr_scheduler.warmup_steps=2.5"], "lr_scheduler.warmup_steps: expected int, got float 2.5"),
        (["--lr_scheduler.decay_type=exponential"], "lr_scheduler.decay_type = 'exponential' is not allowed"),
        (["--training.steps=-5"], "training.steps must be > 0"),
        (
            ["--lr_scheduler.decay_type=cosine", "--lr_scheduler.warmup_steps=10", "--training.steps=10"],
            "training.steps = 10 must exceed lr_scheduler.warmup_steps = 10 for cosine decay",
        ),
        (["--lr_scheduler.min_lr_ratio=1.5"], "lr_scheduler.min_lr_ratio = 1.5 must be in [0, 1]"),
        (["--optimizer.name=lion"], "optimizer.name = 'lion' is not allowed; choose one of ('adamw', 'came')"),
        (["--optimizer.name=came", "--optimizer.betas=[0.9, 0.999]"], "optimizer.betas must have 3 values"),
        (["--optimizer.eps=[0]"], "optimizer.eps must each be > 0"),
        (["--optimizer.betas=[0.9, 'x']"], "optimizer.betas[1]: expected float, got str 'x'"),
    ],
)
def test_the_optimizer_and_schedule_values_the_builders_trust_are_checked_here(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("--training.steps=0", "training.steps must be > 0"),
        ("--training.steps=many", "training.steps: expected int"),
        ("--training.stepz=3", "unknown key training.stepz"),
        ("--trainin.steps=3", "unknown section [trainin]"),
        ("--optimizer.name=sgd", "optimizer.name = 'sgd' is not allowed"),
        ("--model.depthh=3", "depthh"),
        ("--model.use_pe=False", "use_pe='False' for SanaMS_digits: expected true or false"),
        ("--job.stop_grace_period=0", "job.stop_grace_period must be > 0"),
    ],
)
def test_an_error_from_a_command_line_override_names_the_override_not_the_file(tmp_path, override, message):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nsteps = 5\n")
    with pytest.raises(ConfigError) as error:
        load_config(path, ["--training.seed=1", override])
    assert str(error.value).startswith(f"command-line override {override}: ") and message in str(error.value)
    assert str(path) not in str(error.value)


def test_an_error_in_the_file_still_names_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[training]\nsteps = 0\n")
    with pytest.raises(ConfigError, match=f"^{path}: training.steps must be > 0"):
        load_config(path, ["--training.seed=1"])


def test_a_world_size_error_names_the_override_that_caused_it():
    config = load_config(None, ["--parallelism.data_parallel_shard_degree=3"])
    with pytest.raises(ConfigError, match=r"^command-line override --parallelism.data_parallel_shard_degree=3: "):
        ParallelDims.from_config(config, 2)


def test_resume_from_a_step_name_resolves_in_the_checkpoint_folder(tmp_path):
    from sana2.preflight import check_run

    dump = tmp_path / "dump"
    (dump / "ckpt" / "step-4").mkdir(parents=True)
    base = [f"--job.dump_folder={dump}", "--checkpoint.folder=ckpt"]
    assert load_config(None, [*base, "--checkpoint.resume_from=step-4"]).resume_target() == dump / "ckpt" / "step-4"
    other = tmp_path / "elsewhere" / "step-9"
    assert load_config(None, [*base, f"--checkpoint.resume_from={other}"]).resume_target() == other
    for keyword in ("latest", "none"):
        config = load_config(None, [*base, f"--checkpoint.resume_from={keyword}"])
        assert config.resume_target() == keyword
        check_run(config, 1)
    check_run(load_config(None, [*base, "--checkpoint.resume_from=step-4"]), 1)


@pytest.mark.parametrize("value", ["step-7", "lastest", "runs/step-7"])
def test_a_resume_from_that_names_no_checkpoint_is_a_config_error_with_the_path_tried(tmp_path, value, monkeypatch):
    from sana2.preflight import check_run

    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["--job.dump_folder=dump", f"--checkpoint.resume_from={value}"])
    tried = tmp_path / value if "/" in value else tmp_path / "dump" / "checkpoint" / value
    with pytest.raises(ConfigError) as error:
        check_run(config, 1)
    assert str(error.value).startswith(f"command-line override --checkpoint.resume_from={value}: ")
    assert f"checkpoint folder {tried} does not exist (expected latest, none, a step-<N>" in str(error.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--job.dump_folder={data}"], "job.dump_folder = '{data}' is data.path = '{data}'"),
        (["--job.dump_folder={data}/run"], "job.dump_folder = '{data}/run' lies inside data.path"),
        (
            ["--job.dump_folder={tmp}/run", "--checkpoint.initial_load_path={tmp}/run/checkpoint/step-9"],
            "checkpoint.initial_load_path = '{tmp}/run/checkpoint/step-9' lies in this run's checkpoint folder",
        ),
    ],
)
def test_a_run_never_writes_among_or_prunes_its_inputs(tmp_path, overrides, message):
    """A dump folder that is or lies inside the dataset, or a start checkpoint that checkpoint.keep_latest_k
    would delete: refused before the workers start, naming both keys."""
    from sana2.preflight import check_run

    data = tmp_path / "features"
    data.mkdir()
    (tmp_path / "run" / "checkpoint" / "step-9").mkdir(parents=True)
    values = [o.format(data=data, tmp=tmp_path) for o in overrides]
    config = load_config(None, [f"--data.path={data}", *values])
    with pytest.raises(ConfigError, match=re.escape(message.format(data=data, tmp=tmp_path))):
        check_run(config, 1)
    if "initial_load_path" in message:  # with every checkpoint kept, nothing is deleted: allowed
        check_run(load_config(None, [f"--data.path={data}", *values, "--checkpoint.keep_latest_k=0"]), 1)


def test_the_caption_length_is_the_models_and_an_old_data_caption_length_is_read_as_it(tmp_path, monkeypatch):
    import sana2.config

    assert load_config(None).caption_length == 16  # SanaMS_digits' model_max_length
    assert load_config(None, ["--model.model_max_length=24"]).caption_length == 24
    notes = []
    monkeypatch.setattr(sana2.config.logger, "warning", notes.append)
    old = tmp_path / "old.toml"  # a config (or a checkpoint's config.toml) from before the merge
    old.write_text("[data]\ncaption_length = 24\n")
    config = load_config(old)
    assert config.caption_length == 24
    assert config.to_dict()["model"]["model_max_length"] == 24 and "caption_length" not in config.to_dict()["data"]
    assert notes == [f"{old}: data.caption_length is deprecated; read as model.model_max_length = 24"]
    # the same value twice is one setting; two values are refused, naming both keys and where each came from
    assert load_config(old, ["--model.model_max_length=24"]).caption_length == 24
    with pytest.raises(ConfigError) as refused:
        load_config(old, ["--model.model_max_length=16"])
    assert str(refused.value) == (
        f"{old}: data.caption_length = 24 contradicts model.model_max_length = 16 (command-line override "
        "--model.model_max_length=16): they are one setting, model.model_max_length; drop data.caption_length"
    )
    # a bad old value is named by the override that set it
    with pytest.raises(ConfigError, match=r"^command-line override --data.caption_length=0: .*model_max_length=0"):
        load_config(None, ["--data.caption_length=0"])
