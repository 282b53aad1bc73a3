"""LoRA fine-tuning (sana2/components/lora.py): peft adapters on a frozen base loaded from a checkpoint; only
the adapters train and are checkpointed; 1 and 2 ranks give the same run; a resume is exact."""

import numpy as np
import pytest
import torch
from dist_utils import run_distributed
from PIL import Image
from safetensors.torch import save_file
from train_utils import TINY_MODEL, full_model_state, run_steps, tiny_config

from sana2.components.lora import base_name, is_adapter, merged_state, sana2_targets
from sana2.config import ConfigError
from sana2.distributed.initialize import init_weights
from sana2.formats.dcp_folder import read_checked_metadata, stored_shapes
from sana2.models import build_model

STEPS = 4
RANK = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 'released' base model: the tiny digits DiT with its own seeded weights, as a safetensors file."""
    model = build_model("SanaMS_digits", **TINY_MODEL)
    init_weights(model, seed=11)
    path = tmp_path_factory.mktemp("base") / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "pos_embed"}, path)
    return path, model.state_dict()


def lora_flags(base_path, *more):
    return [
        '--model_transforms.names=["lora"]',
        f"--lora.rank={RANK}",
        "--lora.alpha=8",
        f"--checkpoint.initial_load_path={base_path}",
        "--training.global_batch_size=16",
        "--training.ema_decay=0.9",
        "--checkpoint.enable=true",
        "--checkpoint.interval=2",
        "--checkpoint.keep_latest_k=0",
        *more,
    ]


def _lora_run(rank, world_size, dump, out_file, base_path):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *lora_flags(base_path)))
    trainable = sorted(name for name, p in trainer.model.named_parameters() if p.requires_grad)
    optimized = sum(len(group["params"]) for group in trainer.optimizer.param_groups)
    losses = []
    for _ in range(STEPS):
        losses.append(trainer.train_step().loss)
        if trainer.step % 2 == 0:
            trainer.save_checkpoint()
    state = full_model_state(trainer.model)
    del trainer
    # a new process's trainer resumes at step 2 and runs steps 3 and 4 again
    resumed = Trainer(tiny_config(dump, *lora_flags(base_path, "--checkpoint.resume_from=step-2")))
    assert resumed.step == 2
    resumed_losses = run_steps(resumed, STEPS - 2)
    resumed_state = full_model_state(resumed.model)
    if rank == 0:
        torch.save(
            {
                "losses": losses,
                "state": state,
                "trainable": trainable,
                "optimized": optimized,
                "ema": sorted(resumed.ema.shadow),
                "resumed_losses": resumed_losses,
                "resumed_state": resumed_state,
            },
            out_file,
        )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base):
    tmp = tmp_path_factory.mktemp("lora")
    for world_size in (1, 2):
        run_distributed(_lora_run, world_size, tmp / f"run{world_size}", tmp / f"{world_size}.pt", base[0])
    return tmp, {world_size: torch.load(tmp / f"{world_size}.pt") for world_size in (1, 2)}


@pytest.mark.slow
def test_only_the_adapters_train_and_the_base_is_the_loaded_checkpoint(runs, base):
    _, results = runs
    result, (_, base_state) = results[1], base
    adapters = [name for name in result["state"] if is_adapter(name)]
    assert result["trainable"] == sorted(adapters) == result["ema"]
    assert result["optimized"] == len(adapters) == 2 * 3 * TINY_MODEL["depth"]  # A and B of 3 layers per block
    for name, value in result["state"].items():
        if not is_adapter(name) and name in base_state:
            assert torch.equal(value, base_state[base_name(name)]), name  # the frozen base did not move
    lora_b = [value for name, value in result["state"].items() if ".lora_B." in name]
    assert all(value.abs().max() > 0 for value in lora_b)  # B starts at 0 and has trained


@pytest.mark.slow
def test_two_ranks_give_the_single_process_run_and_a_resume_is_exact(runs):
    _, results = runs
    one, two = results[1], results[2]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), atol=1e-5, rtol=0)
    for name, value in one["state"].items():
        torch.testing.assert_close(two["state"][name], value, atol=1e-5, rtol=0, msg=name)
    for result in (one, two):
        assert result["resumed_losses"] == result["losses"][2:]
        for name, value in result["state"].items():
            assert torch.equal(result["resumed_state"][name], value), name


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapters_and_names_its_base(runs, base):
    tmp, _ = runs
    folder = tmp / "run2" / "checkpoint" / "step-4"
    stored = stored_shapes(read_checked_metadata(folder, require_complete=True))
    model_keys = {key.removeprefix("model.") for key in stored if key.startswith("model.")}
    assert {key for key in model_keys if not is_adapter(key)} <= {"y_embedder.y_embedding", "pos_embed"}
    assert {key for key in stored if key.startswith("ema.")} == {f"ema.{k}" for k in model_keys if is_adapter(k)}
    assert str(base[0]) in (folder / "config.toml").read_text()


@pytest.mark.slow
def test_sana2_sample_of_a_lora_step_folder_draws_the_merged_model(runs, tmp_path):
    from sana2.sample import main as sample

    tmp, results = runs
    folder = tmp / "run1" / "checkpoint" / "step-4"
    merged = tmp_path / "merged.safetensors"
    save_file({k: v.contiguous() for k, v in merge(results[1]["state"]).items() if k != "pos_embed"}, merged)
    flags = ["--prompt", "the number 7", "--steps", "4", "--images-per-prompt", "1"]
    assert sample([str(folder), "--out", str(tmp_path / "lora"), *flags]) == 0
    config = ["--config", str(folder / "config.toml")]
    assert sample([str(merged), "--out", str(tmp_path / "merged"), *config, *flags]) == 0
    lora_image, merged_image = (
        np.asarray(Image.open(tmp_path / n / "0-the_number_7.png")).astype(int) for n in ("lora", "merged")
    )
    assert np.abs(lora_image - merged_image).max() <= 1  # B A added into W, or beside it: float32 rounding


def merge(state):
    return merged_state(state, 8 / RANK)  # alpha / rank


def test_diffusers_target_names_map_to_sanas_fused_layers_and_unknown_ones_are_refused(tmp_path):
    assert sana2_targets(["to_q", "to_k", "to_v"]) == ["attn.qkv", "cross_attn.q_linear", "cross_attn.kv_linear"]
    assert sana2_targets(["attn2.to_k", "to_out.0"]) == ["cross_attn.kv_linear", "attn.proj", "cross_attn.proj"]
    from sana2.components import lora

    config = tiny_config(tmp_path, '--model_transforms.names=["lora"]', '--lora.target_modules=["to_q", "ff.conv"]')
    with torch.device("meta"):
        model = build_model(config.model.name, **config.model.overrides)
    with pytest.raises(ConfigError, match="lora.target_modules: ff.conv match no linear layer"):
        lora.add_adapters(model, config)
    with pytest.raises(ConfigError, match="lora.rank must be > 0"):
        tiny_config(tmp_path, "--lora.rank=0")


def _short_lora_run(rank, world_size, dump, base_path):
    from sana2.train import Trainer

    trainer = Trainer(tiny_config(dump, *lora_flags(base_path)))
    run_steps(trainer, 2)
    trainer.save_checkpoint()


@pytest.fixture(scope="module")
def lora_step(tmp_path_factory, base):
    """A one-rank LoRA run's step folder after 2 steps (trained adapters and EMA)."""
    dump = tmp_path_factory.mktemp("short_lora")
    run_distributed(_short_lora_run, 1, dump, base[0])
    return dump / "checkpoint" / "step-2"


def sampled_merged_model(folder, ema=False):
    """The merged weights of the model sana2-sample draws from a LoRA step folder (sana2.sample.load_model)."""
    from sana2.components import lora
    from sana2.config import load_config
    from sana2.sample import load_model

    config = load_config(folder / "config.toml")
    model, _ = load_model(config, folder, ema, torch.float32, torch.device("cpu"), None)
    return merged_state(model.state_dict(), lora.scaling(config.lora))


def load_step(folder):
    """The model tensors a step folder holds (the adapters and the null caption), as saved."""
    from sana2.formats.dcp_folder import DcpCheckpoint

    source = DcpCheckpoint(folder)
    return {path[1]: source.tensor(key).read() for key, path in source.paths("model").items() if len(path) == 2}


@pytest.mark.slow
@pytest.mark.parametrize("form", ["accelerate", "pth", "safetensors", "diffusers"])
def test_merge_lora_exports_the_model_sana2_sample_draws_in_every_format(lora_step, base, tmp_path, form):
    from safetensors.torch import load_file

    from sana2.formats.full_model import read_full_checkpoint
    from sana2.tools.convert_checkpoint import main as convert

    out = tmp_path / ("out" if form in ("accelerate", "diffusers") else f"out.{form}")
    assert convert([str(lora_step), str(out), "--format", form, "--merge-lora"]) == 0
    if form == "diffusers":
        exported = {t.name: t.read() for t in read_full_checkpoint(out)}  # read back in sana2's names
    elif form == "safetensors":
        exported = load_file(out)
    else:
        path = next(out.glob("*.pth")) if form == "accelerate" else out
        exported = torch.load(path, weights_only=True)["state_dict"]
    expected = sampled_merged_model(lora_step)
    assert set(exported) == set(expected)  # diffusers' folder holds no pos_embed: its reader computes it
    for name, value in exported.items():
        assert torch.equal(value, expected[name]), name
    # the adapters did move the model: the export is its base plus alpha / rank * B A
    qkv, (_, base_state) = "blocks.0.attn.qkv.weight", base
    lora_a, lora_b = (load_step(lora_step)[f"blocks.0.attn.qkv.lora_{x}.default.weight"] for x in "AB")
    assert not torch.equal(exported[qkv], base_state[qkv])
    torch.testing.assert_close(exported[qkv], base_state[qkv] + 8 / RANK * lora_b @ lora_a, atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("ema", [False, True], ids=["model", "ema"])
def test_the_diffusers_lora_export_loads_in_sana_pipeline_as_the_merged_model(lora_step, base, tmp_path, ema):
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from safetensors.torch import load_file

    from sana2.formats.diffusers import export_pieces
    from sana2.tools.convert_checkpoint import main as convert

    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    flags = ["--ema"] if ema else []
    assert convert([str(lora_step), str(merged), "--format", "diffusers", "--merge-lora", *flags]) == 0
    assert convert([str(lora_step), str(adapters), "--format", "diffusers-lora", *flags]) == 0
    written = load_file(adapters / "pytorch_lora_weights.safetensors")
    # a .safetensors output is the file itself, re-read against the source (--verify) and replaced by --overwrite
    single = tmp_path / "adapters.safetensors"
    assert convert([str(lora_step), str(single), "--format", "diffusers-lora", "--verify", *flags]) == 0
    assert convert([str(lora_step), str(single), "--format", "diffusers-lora", "--overwrite", *flags]) == 0
    assert load_file(single).keys() == written.keys()
    # fused qkv: one A for to_q, to_k, to_v; 3 modules of self- and 3 of cross-attention per block, A and B each
    assert len(written) == 2 * 6 * TINY_MODEL["depth"]
    block = "transformer.transformer_blocks.1"
    assert torch.equal(written[f"{block}.attn1.to_q.lora_A.weight"], written[f"{block}.attn1.to_v.lora_A.weight"])
    assert torch.equal(written[f"{block}.attn2.to_k.lora_A.weight"], written[f"{block}.attn2.to_v.lora_A.weight"])

    _, base_state = base  # the LoRA run's base, exported to diffusers' names, in diffusers' model
    transformer = SanaTransformer2DModel.from_pretrained(merged).eval()
    exported_base = {p.name: p.take(t) for k, t in base_state.items() for p in export_pieces(k, False)}
    transformer.load_state_dict(exported_base, strict=True)
    pipeline = SanaPipeline(None, None, None, transformer, FlowMatchEulerDiscreteScheduler())
    pipeline.load_lora_weights(adapters)
    reference = SanaTransformer2DModel.from_pretrained(merged).eval()  # sana2's merged model in diffusers

    generator = torch.Generator().manual_seed(0)
    config = reference.config
    x = torch.randn(2, config.in_channels, 8, 8, generator=generator)
    y = torch.randn(2, 6, config.caption_channels, generator=generator)
    timestep = torch.tensor([50.0, 700.0])
    with torch.no_grad():
        lora_out, merged_out = (model(x, y, timestep).sample for model in (pipeline.transformer, reference))
        pipeline.disable_lora()
        base_out = pipeline.transformer(x, y, timestep).sample
        pipeline.enable_lora()
    assert (lora_out - base_out).abs().max() > 1e-3  # the adapters are applied: the output moved off the base
    torch.testing.assert_close(lora_out, merged_out, atol=1e-5, rtol=0)  # W x + B A x against (W + B A) x
    pipeline.fuse_lora()
    fused = {k.replace(".base_layer.", "."): v for k, v in pipeline.transformer.state_dict().items() if "lora" not in k}
    assert fused.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(fused[name], value, atol=1e-6, rtol=0, msg=name)  # W + B A, in diffusers' order
