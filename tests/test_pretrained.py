"""A released diffusers Sana pipeline as the starting point (`[model] pretrained`, `--pretrained`): each
component a default its own key overrides, and sana2-sample of the pipeline draws SanaPipeline's image.
The pipeline is tiny and written in the test (tests/pipeline_factory.py); nothing is downloaded."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from PIL import Image
from pipeline_factory import FLOW_SHIFT, exported_transformer, save_tiny_pipeline

from sana2.components.initial_load import load_initial_weights
from sana2.components.sampling import sampling_noise
from sana2.config import ConfigError, load_config
from sana2.encoders.text_encoder import SANA_INSTRUCTION_LINES
from sana2.formats.diffusers_folder import NULL_CAPTION_KEY
from sana2.formats.pipeline import PIPELINE_CAPTION_LENGTH, pipeline_defaults
from sana2.models import build_model
from sana2.prepare import parse_args
from sana2.sample import main as sample
from sana2.staging import OUTPUT_MARKER


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    return save_tiny_pipeline(tmp_path_factory.mktemp("released") / "Sana_tiny_diffusers")


def pretrained(pipeline, *overrides):
    return load_config(None, [f"--model.pretrained={pipeline}", *overrides], pipeline_defaults)


def test_a_pipeline_folder_gives_every_component_and_its_transformers_weights(pipeline):
    config = pretrained(pipeline)
    assert config.checkpoint.initial_load_path == str(pipeline / "transformer")
    assert (config.encoding.text_encoder, config.encoding.vae) == (
        str(pipeline / "text_encoder"),
        str(pipeline / "vae"),
    )
    assert config.validation.vae == str(pipeline / "vae")
    assert (config.training.flow_shift, config.validation.scheduler, config.validation.cfg_scale) == (
        3.0,
        "dpm-solver",
        4.5,
    )
    assert config.caption_length == config.model.overrides["model_max_length"] == PIPELINE_CAPTION_LENGTH
    model = build_model(config.model.name, **config.model.overrides)
    kept = load_initial_weights(model, config.checkpoint.initial_load_path)
    assert kept == [NULL_CAPTION_KEY]  # a released transformer holds no null caption
    reference, _ = exported_transformer()
    for name, tensor in reference.state_dict().items():
        if name != NULL_CAPTION_KEY:
            assert torch.equal(model.state_dict()[name], tensor), name


def test_each_component_is_overridden_by_its_own_key(pipeline):
    config = pretrained(
        pipeline, "--training.flow_shift=1.5", "--validation.scheduler=euler", "--encoding.vae=none", "--model.depth=2"
    )
    assert (config.training.flow_shift, config.validation.scheduler, config.encoding.vae) == (1.5, "euler", "none")
    assert config.validation.vae == str(pipeline / "vae") and config.model.overrides["hidden_size"] == 64
    other_model = pretrained(pipeline, "--model.name=SanaMS_debug")  # another model: none of the pipeline's keywords
    assert other_model.model.overrides == {} and other_model.encoding.text_encoder == str(pipeline / "text_encoder")


def test_a_folder_that_is_no_pipeline_or_a_hub_id_not_in_the_cache_is_refused(pipeline, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=f"model.pretrained = '{tmp_path}': .* not a diffusers pipeline folder"):
        pretrained(tmp_path)
    with pytest.raises(ConfigError, match="no-such-folder: no such folder"):
        pretrained(tmp_path / "no-such-folder")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(ConfigError, match="Efficient-Large-Model/Sana_none: not a local folder, and the local cache"):
        pretrained("Efficient-Large-Model/Sana_none")


def test_prepare_takes_the_pipelines_vae_and_text_encoder(pipeline, tmp_path, capsys):
    options = parse_args(["in", "--output", "o", "--buckets", "64x64", "--pretrained", str(pipeline)])
    assert (options.encoding.vae, options.encoding.text_encoder) == (
        str(pipeline / "vae"),
        str(pipeline / "text_encoder"),
    )
    options = parse_args(["in", "--output", "o", "--buckets", "64x64", "--pretrained", str(pipeline), "--vae", "none"])
    assert options.encoding.vae == "none"
    with pytest.raises(SystemExit):
        parse_args(["in", "--output", "o", "--buckets", "64x64"])
    assert "--vae (or the config's encoding.vae) must name" in capsys.readouterr().err


def sana_pipeline_image(pipeline, **options):
    """SanaPipeline's 64x64 image of "a red fox" from sana2-sample's noise for seed 0, as 0-255 integers."""
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(
        prompt="a red fox",
        latents=sampling_noise(0, 1, (4, 32, 32)),
        height=64,
        width=64,
        use_resolution_binning=False,
        output_type="np",
        **options,
    ).images[0]
    return (image * 255).round().astype(int)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "transformer", "flag"])
def test_sana2_sample_of_a_pipeline_draws_sana_pipelines_image(pipeline, tmp_path, capsys, where):
    """Same weights, text encoder, VAE, scheduler, noise and settings: the PNG is SanaPipeline's image within
    one level of 255 (both round the same float32 pixels; the latents agree within 1e-5)."""
    from diffusers import SanaPipeline

    out = tmp_path / "fox"
    source = {
        "root": [str(pipeline)],
        "transformer": [str(pipeline / "transformer")],
        "flag": ["--pretrained", str(pipeline)],
    }
    flags = ["--prompt", "a red fox", "--out", str(out), "--images-per-prompt", "1", "--height", "64", "--width", "64"]
    assert sample([*source[where], *flags]) == 0
    message = capsys.readouterr().out
    assert f"20 dpm-solver steps, cfg 4.5, flow shift {FLOW_SHIFT}" in message
    ours = np.asarray(Image.open(out / "0-a_red_fox.png")).astype(int)  # the image alone, no frame
    theirs = sana_pipeline_image(SanaPipeline.from_pretrained(pipeline))
    assert ours.shape == theirs.shape == (64, 64, 3)
    assert np.abs(ours - theirs).max() <= 1 and ours.std() > 5


@pytest.mark.parametrize("preset", ["finetune_sana_1600m_1024_lora", "finetune_sana_1600m_1024_full"])
def test_the_fine_tuning_presets_take_everything_else_from_their_pipeline(pipeline, preset):
    path = Path(__file__).resolve().parents[1] / "train_configs" / f"{preset}.toml"
    config = load_config(path, [f"--model.pretrained={pipeline}"], pipeline_defaults)
    assert config.checkpoint.initial_load_path == str(pipeline / "transformer")
    assert (config.encoding.text_encoder, config.validation.vae) == (
        str(pipeline / "text_encoder"),
        str(pipeline / "vae"),
    )
    assert (config.training.flow_shift, config.validation.freq, config.validation.cfg_scale) == (3.0, 250, 4.5)
    assert config.optimizer.name == "adamw" and 1000 <= config.training.steps <= 5000
    assert ("lora" in config.model_transforms.names) == preset.endswith("lora") and (
        config.training.ema_decay > 0
    ) == preset.endswith("full")
    assert config.optimizer.lr == (1e-4 if preset.endswith("lora") else 1e-5)


# -- sana2-convert --format diffusers-pipeline: a run's checkpoint as a pipeline folder ------------------------


@pytest.fixture(scope="module")
def finetuned(pipeline, tmp_path_factory):
    """A step folder as a run started from the pipeline saves one: its own transformer weights (seeded apart from
    the pipeline's), the null caption the trainer stores (the empty prompt's embedding), the run's config."""
    from safetensors.torch import save_file

    from sana2.components.validator import encode_on_rank0
    from sana2.distributed.initialize import init_weights
    from sana2.encoders.text_encoder import store_null_caption
    from sana2.tools.convert_checkpoint import main as convert

    tmp = tmp_path_factory.mktemp("finetuned")
    config = pretrained(pipeline, f"--job.dump_folder={tmp / 'dump'}")
    model = build_model(config.model.name, **config.model.overrides)
    init_weights(model, seed=9)
    null_embeds = encode_on_rank0(config.encoding, config.caption_length, [""])[2]
    store_null_caption(model, null_embeds.reshape(model.get_buffer(NULL_CAPTION_KEY).shape))
    weights = tmp / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "pos_embed"}, weights)
    folder = tmp / "dump" / "checkpoint" / "step-0"
    assert convert(["--to-dcp", str(weights), str(folder)]) == 0
    (folder / "config.toml").write_text(config.to_toml())
    (folder / "config.json").write_text(config.to_json())
    return folder, model.state_dict()


def sana2_image(source, out, *flags):
    """sana2-sample's 64x64 image of "a red fox" (seed 0) into the folder `out`, as 0-255 integers."""
    common = ["--prompt", "a red fox", "--images-per-prompt", "1", "--height", "64", "--width", "64"]
    assert sample([*source, "--out", str(out), *common, *flags]) == 0
    return np.asarray(Image.open(out / "0-a_red_fox.png")).astype(int)


@pytest.fixture(scope="module")
def exported_pipeline(finetuned, tmp_path_factory):
    from sana2.tools.convert_checkpoint import main as convert

    out = tmp_path_factory.mktemp("exported") / "Sana_finetuned"
    assert convert([str(finetuned[0]), str(out), "--format", "diffusers-pipeline", "--verify"]) == 0
    return out


@pytest.mark.slow
def test_the_pipeline_export_loads_in_sana_pipeline_and_draws_sana2_samples_image(
    finetuned, exported_pipeline, tmp_path
):
    """Same seed and settings: SanaPipeline.from_pretrained(export) draws the step folder's sana2-sample PNG within
    one level of 255 (as the sampler-equivalence test above)."""
    from diffusers import DPMSolverMultistepScheduler, SanaPipeline

    assert sorted(p.name for p in exported_pipeline.iterdir()) == [
        "model_index.json",
        OUTPUT_MARKER,  # sana2-convert's: a later --overwrite replaces this folder, and nothing it did not write
        "scheduler",
        "text_encoder",
        "tokenizer",
        "transformer",
        "vae",
    ]
    ours = sana2_image([str(finetuned[0])], tmp_path / "step")
    loaded = SanaPipeline.from_pretrained(exported_pipeline)
    assert isinstance(loaded.scheduler, DPMSolverMultistepScheduler) and loaded.scheduler.config.flow_shift == 3.0
    # Sana's instruction, as sana2 encodes with it: diffusers' default quotes 'Enhanced prompt' where Sana's has
    # "Enhanced prompt", which moves the tiny Gemma's embedding by 0.04
    theirs = sana_pipeline_image(loaded, complex_human_instruction=SANA_INSTRUCTION_LINES)
    assert ours.shape == theirs.shape == (64, 64, 3)
    assert np.abs(ours - theirs).max() <= 1 and ours.std() > 5


@pytest.mark.slow
def test_a_pipeline_export_is_replaced_only_with_overwrite(finetuned, tmp_path, capsys):
    from sana2.tools.convert_checkpoint import main as convert

    out = tmp_path / "Sana_finetuned"
    export = [str(finetuned[0]), str(out), "--format", "diffusers-pipeline"]
    assert convert(export) == 0
    assert convert(export) == 2 and "pass --overwrite to replace it" in capsys.readouterr().err
    assert convert([*export, "--overwrite"]) == 0
    someone_elses = tmp_path / "someone_elses"
    (someone_elses / "vae").mkdir(parents=True)
    assert convert([str(finetuned[0]), str(someone_elses), "--format", "diffusers-pipeline", "--overwrite"]) == 2
    assert (someone_elses / "vae").is_dir()


@pytest.mark.slow
def test_the_pipeline_export_is_a_starting_point_for_training_and_sampling(finetuned, exported_pipeline, tmp_path):
    folder, state = finetuned
    config = pretrained(exported_pipeline)
    assert config.checkpoint.initial_load_path == str(exported_pipeline / "transformer")
    assert (config.encoding.text_encoder, config.validation.vae) == (
        str(exported_pipeline / "text_encoder"),
        str(exported_pipeline / "vae"),
    )
    assert (config.training.flow_shift, config.validation.scheduler) == (3.0, "dpm-solver")
    model = build_model(config.model.name, **config.model.overrides)
    assert load_initial_weights(model, config.checkpoint.initial_load_path) == []  # the null caption came along
    for name, tensor in state.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    step = sana2_image([str(folder)], tmp_path / "step")
    assert np.array_equal(sana2_image(["--pretrained", str(exported_pipeline)], tmp_path / "pipeline"), step)


def test_a_pipeline_export_needs_a_vae_and_text_encoder_folder_and_writes_nothing_among_its_inputs(
    pipeline, finetuned, tmp_path, capsys
):
    import shutil

    from sana2.tools.convert_checkpoint import main as convert

    digits_like = tmp_path / "step-0"
    shutil.copytree(finetuned[0], digits_like)
    config = pretrained(pipeline, "--encoding.text_encoder=tiny-t5", "--encoding.vae=none", "--validation.vae=none")
    (digits_like / "config.toml").write_text(config.to_toml())
    capsys.readouterr()
    assert convert([str(digits_like), str(tmp_path / "out"), "--format", "diffusers-pipeline"]) == 2
    err = capsys.readouterr().err
    assert "needs vae/ and text_encoder/, but the run names no VAE folder" in err and "'tiny-t5'" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    inside = pipeline / "vae" / "exported"  # the run's VAE folder is an input: nothing is written in it
    assert convert([str(finetuned[0]), str(inside), "--format", "diffusers-pipeline"]) == 2
    assert f"it lies inside the input {pipeline / 'vae'}" in capsys.readouterr().err
    assert not inside.exists()
