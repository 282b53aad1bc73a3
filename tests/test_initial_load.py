"""checkpoint.initial_load_path: every full-model format and DCP folders fill the sharded model exactly
as loading the file into an unsharded model does; model only; mismatches are reported by key."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from train_utils import full_model_state, run_steps, tiny_config

from sana2.components.checkpoint import CheckpointError
from sana2.components.initial_load import load_initial_weights
from sana2.distributed.initialize import init_weights
from sana2.distributed.parallelize import apply_fsdp
from sana2.formats.diffusers import diffusers_config, import_sources, join
from sana2.formats.diffusers_folder import (
    NULL_CAPTION_KEY,
    NULL_CAPTION_NAME,
    STEM,
    diffusers_tensors,
    write_diffusers_folder,
)
from sana2.formats.tensors import SourceTensor
from sana2.models import build_model
from sana2.tools.convert_checkpoint import main as convert

MODEL = ("SanaMS_digits", {"depth": 2, "hidden_size": 64, "num_heads": 2})  # the model of train_utils.TINY
INIT_SEED = 5  # the target model's own initialisation: what pos_embed keeps


def unsharded_model() -> torch.nn.Module:
    model = build_model(MODEL[0], **MODEL[1])
    init_weights(model, INIT_SEED)
    return model


def random_state_dict(seed: int) -> dict[str, torch.Tensor]:
    """A full state dict for the model with every tensor random, pos_embed included (it must be ignored)."""
    generator = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=generator) for k, v in unsharded_model().state_dict().items()}


def _write_dcp(state: dict, folder: Path) -> None:
    dcp.save(state, checkpoint_id=folder, no_dist=True)


def _write_safetensors_index(state: dict, folder: Path) -> Path:
    """Hugging Face's sharded layout: model.safetensors.index.json and three shards."""
    names = list(state)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({name: state[name] for name in shard}, folder / file)
        weight_map.update({name: file for name in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _read_safetensors_folder(folder: Path) -> dict:
    files = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    return {k: v for file in sorted(files) for k, v in load_file(folder / file).items()}


def _to_dcp(state: dict, folder: Path, keep_pos_embed: bool = True) -> Path:
    """`sana2-convert --to-dcp` of the reference's .pth (with or without pos_embed): a step-0 DCP folder."""
    state = {k: v for k, v in state.items() if keep_pos_embed or k != "pos_embed"}
    torch.save({"state_dict": state}, folder / "model.pth")
    assert convert(["--to-dcp", str(folder / "model.pth"), str(folder / "step-0")]) == 0
    return folder / "step-0"


def _converted_safetensors_shards(state: dict, folder: Path) -> Path:
    """`sana2-convert --format safetensors` of a DCP checkpoint into an index and shards."""
    assert (
        convert(
            [
                str(_to_dcp(state, folder)),
                str(folder / "exported"),
                "--format",
                "safetensors",
                "--max-shard-size",
                "100KB",
            ]
        )
        == 0
    )
    assert len(list((folder / "exported").glob("model-*.safetensors"))) > 1
    return folder / "exported"


def _write_diffusers(state: dict, folder: Path, null_caption: bool) -> Path:
    """A diffusers folder of the model, in shards (each sana2 tensor's rows then span files); with sana2's
    null-caption file, or without it as Sana's released folders are."""
    weights = [SourceTensor.of(key, value) for key, value in state.items()]
    null = [weight for weight in weights if weight.name == NULL_CAPTION_KEY and null_caption]
    config = diffusers_config(MODEL[0], MODEL[1])
    (folder / "diffusers").mkdir()
    write_diffusers_folder(folder / "diffusers", config, diffusers_tensors(weights, False), null, {}, 60_000)
    return folder / "diffusers"


def _read_diffusers(folder: Path) -> dict:
    """The reference's way: every diffusers tensor, joined back as diffusers' conversion splits them."""
    stored = {k: v for file in folder.glob(f"{STEM}-*.safetensors") for k, v in load_file(file).items()}
    state = {
        key: join([stored[n] for n in names]) for key, names in import_sources(random_state_dict(0), False).items()
    }
    if (folder / NULL_CAPTION_NAME).exists():
        state.update(load_file(folder / NULL_CAPTION_NAME))
    return state


# name -> (write the state dict in this format under a folder and return the path to give,
#          read that path as its own format's loader does)
FORMATS = {
    "reference epoch_E_step_S.pth": (
        lambda sd, d: torch.save({"state_dict": sd}, d / "epoch_1_step_10.pth") or d / "epoch_1_step_10.pth",
        lambda path: torch.load(path)["state_dict"],
    ),
    "accelerate pytorch_model_fsdp.bin": (
        lambda sd, d: torch.save(sd, d / "pytorch_model_fsdp.bin") or d / "pytorch_model_fsdp.bin",
        torch.load,
    ),
    "accelerate model folder": (
        lambda sd, d: torch.save(sd, d / "pytorch_model_fsdp.bin") or d,
        lambda path: torch.load(path / "pytorch_model_fsdp.bin"),
    ),
    "plain state dict": (lambda sd, d: torch.save(sd, d / "model.pt") or d / "model.pt", torch.load),
    "DDP-prefixed state dict": (
        lambda sd, d: torch.save({f"module.{k}": v for k, v in sd.items()}, d / "ddp.pt") or d / "ddp.pt",
        lambda path: {k.removeprefix("module."): v for k, v in torch.load(path).items()},
    ),
    "legacy non-zip torch file": (
        lambda sd, d: torch.save(sd, d / "legacy.pt", _use_new_zipfile_serialization=False) or d / "legacy.pt",
        torch.load,
    ),
    "safetensors": (lambda sd, d: save_file(sd, d / "model.safetensors") or d / "model.safetensors", load_file),
    "safetensors folder with model.safetensors": (
        lambda sd, d: save_file(sd, d / "model.safetensors") or d,
        lambda path: load_file(path / "model.safetensors"),
    ),
    "safetensors index and shards": (_write_safetensors_index, _read_safetensors_folder),
    "sana2-convert safetensors shards": (_converted_safetensors_shards, _read_safetensors_folder),
    "sana2-convert --to-dcp folder": (_to_dcp, lambda path: _read_dcp(path)["model"]),
    "sana2-convert --to-dcp folder without pos_embed": (
        lambda sd, d: _to_dcp(sd, d, keep_pos_embed=False),
        lambda path: _read_dcp(path)["model"],
    ),
    "DCP folder with model, optimizer and EMA": (
        lambda sd, d: (
            _write_dcp(
                {
                    "model": sd,
                    "ema": {k: v + 1 for k, v in sd.items()},
                    "optimizer": {"state": {k: {"exp_avg": v * 2} for k, v in sd.items()}},
                },
                d,
            )
            or d
        ),
        lambda path: _read_dcp(path)["model"],
    ),
    "DCP folder with bare keys": (lambda sd, d: _write_dcp(sd, d) or d, lambda path: _read_dcp(path)),
    "diffusers folder from sana2-convert": (lambda sd, d: _write_diffusers(sd, d, True), _read_diffusers),
    "diffusers folder without null caption": (lambda sd, d: _write_diffusers(sd, d, False), _read_diffusers),
}


def _read_dcp(folder: Path) -> dict:
    dcp_to_torch_save(folder, folder.parent / f"{folder.name}.pt")
    return torch.load(folder.parent / f"{folder.name}.pt")


def expected_after_loading(fmt: str, path: Path) -> dict[str, torch.Tensor]:
    """The reference's way: read the file whole, drop pos_embed, load into an unsharded model (strict=False)."""
    state = FORMATS[fmt][1](path)
    state.pop("pos_embed", None)  # absent from a file made without it
    model = unsharded_model()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a diffusers folder from elsewhere holds no null caption: the model keeps its own
    assert missing in (["pos_embed"], ["pos_embed", NULL_CAPTION_KEY]) and not unexpected
    return model.state_dict()


@pytest.fixture(scope="module")
def format_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    state = random_state_dict(seed=17)
    paths = {}
    for index, (fmt, (write, _)) in enumerate(FORMATS.items()):
        folder = root / f"format{index}"
        folder.mkdir()
        paths[fmt] = write(state, folder)
    return paths


def _load_every_format_sharded(rank, world_size, paths, out_file):
    results = {}
    for fmt, path in paths.items():
        with torch.device("meta"):
            model = build_model(MODEL[0], **MODEL[1])
        apply_fsdp(model, init_device_mesh("cpu", (world_size,)), param_dtype=torch.float32)
        model.to_empty(device="cpu")
        init_weights(model, INIT_SEED)
        load_initial_weights(model, path)
        results[fmt] = full_model_state(model)
    if rank == 0:
        torch.save(results, out_file)


@pytest.fixture(scope="module")
def sharded_results(format_files, tmp_path_factory) -> dict[str, dict]:
    out_file = tmp_path_factory.mktemp("sharded") / "results.pt"
    run_distributed(_load_every_format_sharded, 2, format_files, out_file)
    return torch.load(out_file)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.slow
def test_each_format_loads_into_the_sharded_model_as_into_an_unsharded_one(fmt, format_files, sharded_results):
    expected = expected_after_loading(fmt, format_files[fmt])
    loaded = sharded_results[fmt]
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    assert not torch.equal(loaded["pos_embed"], random_state_dict(seed=17)["pos_embed"])  # kept its own value


# -- the trainer: model only, EMA from the loaded weights, a resume wins --------------------------


def _train_from_initial_weights(rank, world_size, runs, weights, out_file):
    from sana2.train import Trainer

    overrides = (
        "--checkpoint.enable=true",
        "--training.ema_decay=0.9",
        "--training.global_batch_size=16",
        f"--checkpoint.initial_load_path={weights}",
    )
    started = Trainer(tiny_config(runs / "initial", *overrides))
    outcome = {
        "step": started.step,
        "optimizer_state": len(started.optimizer.state),
        "scheduler_epoch": started.lr_scheduler.last_epoch,
        "model": full_model_state(started.model),
        "ema": {k: v.full_tensor() for k, v in started.ema.shadow.items()},
    }
    run_steps(started, 1)
    started.save_checkpoint(final=True)
    trained = full_model_state(started.model)
    resumed = Trainer(tiny_config(runs / "initial", *overrides))  # a checkpoint exists: it wins
    outcome.update(resumed_step=resumed.step, resumed_model=full_model_state(resumed.model), trained_model=trained)
    if rank == 0:
        torch.save(outcome, out_file)


@pytest.mark.parametrize(
    "fmt",
    [
        "reference epoch_E_step_S.pth",
        "sana2-convert --to-dcp folder",
        "sana2-convert --to-dcp folder without pos_embed",
        "diffusers folder without null caption",
    ],
)
@pytest.mark.slow
def test_trainer_starts_from_initial_weights_with_fresh_optimizer_and_ema_and_a_resume_wins(
    format_files, tmp_path, fmt
):
    weights = format_files[fmt]
    run_distributed(_train_from_initial_weights, 2, tmp_path, weights, tmp_path / "outcome.pt")
    outcome = torch.load(tmp_path / "outcome.pt")
    expected = expected_after_loading(fmt, weights)
    if "without null caption" in fmt:  # the trainer's own null caption stays: its initial value
        own = build_model(MODEL[0], **MODEL[1])
        init_weights(own, tiny_config(tmp_path).training.seed)
        expected[NULL_CAPTION_KEY] = own.state_dict()[NULL_CAPTION_KEY]
    assert outcome["step"] == 0 and outcome["optimizer_state"] == 0 and outcome["scheduler_epoch"] == 0
    for key, value in expected.items():
        assert torch.equal(outcome["model"][key], value), key
    for key, value in outcome["ema"].items():
        assert torch.equal(value, expected[key]), key  # the average starts at the loaded weights
    assert outcome["resumed_step"] == 1
    for key, value in outcome["trained_model"].items():
        assert torch.equal(outcome["resumed_model"][key], value), key


# -- mismatches: one message naming the keys ------------------------------------------------------


def _wrong_shape(sd):
    sd["final_layer.linear.weight"] = torch.zeros(5, 64)


def _missing_key(sd):
    del sd["t_block.1.bias"]


def _unexpected_key(sd):
    sd["blocks.7.attn.qkv.weight"] = torch.zeros(3)


MISMATCHES = [  # {prefix}: "model." in a DCP folder, where the trainer's and Accelerate's keys carry it
    ("shape", _wrong_shape, "{prefix}final_layer.linear.weight has shape (5, 64), this run needs (1, 64)"),
    ("missing key", _missing_key, "{prefix}t_block.1.bias is missing"),
    ("unexpected key", _unexpected_key, "{prefix}blocks.7.attn.qkv.weight is stored but this model has no such tensor"),
]


@pytest.mark.parametrize(
    "container",
    ["plain state dict", "safetensors", "safetensors index and shards", "DCP folder with model, optimizer and EMA"],
)
@pytest.mark.parametrize("change, message", [m[1:] for m in MISMATCHES], ids=[m[0] for m in MISMATCHES])
def test_a_mismatched_file_is_reported_by_key_and_loads_nothing(tmp_path, container, change, message):
    state = random_state_dict(seed=3)
    change(state)
    path = FORMATS[container][0](state, tmp_path)
    model = unsharded_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as raised:
        load_initial_weights(model, path)
    assert str(path) in str(raised.value)
    assert message.format(prefix="model." if container.startswith("DCP") else "") in str(raised.value)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_pos_embed_of_another_size_is_ignored(tmp_path):
    state = random_state_dict(seed=3)
    state["pos_embed"] = torch.zeros(1, 9, 64)
    torch.save(state, tmp_path / "model.pt")
    model = unsharded_model()
    load_initial_weights(model, tmp_path / "model.pt")
    assert torch.equal(model.state_dict()["blocks.0.attn.qkv.weight"], state["blocks.0.attn.qkv.weight"])


UNREADABLE = [
    ("no such path", lambda d: d / "nothing.pth", r"initial_load_path \S+/nothing.pth does not exist"),
    (
        "not a state dict",
        lambda d: torch.save([1, 2], d / "list.pt") or d / "list.pt",
        r"\S+/list.pt holds no state dict",
    ),
    (
        "garbage bytes",
        lambda d: (d / "junk.pth").write_bytes(b"junk" * 100) and d / "junk.pth",
        r"cannot read \S+/junk.pth",
    ),
    (
        "garbage safetensors",
        lambda d: (d / "junk.safetensors").write_bytes(b"junk" * 100) and d / "junk.safetensors",
        r"cannot read \S+/junk.safetensors",
    ),
    (
        "DCP folder without metadata",
        lambda d: (d / "empty").mkdir() or d / "empty",
        r"\S+/empty is not a DCP checkpoint: \S+/empty/.metadata is missing",
    ),
    (
        "safetensors index naming a missing shard",
        lambda d: (
            (_write_safetensors_index(random_state_dict(1), d) / "model-00002-of-00003.safetensors").unlink() or d
        ),
        r"safetensors file \S+/model-00002-of-00003.safetensors is missing",
    ),
    (
        "safetensors index not matching its shards",
        lambda d: _index_moving_a_tensor(_write_safetensors_index(random_state_dict(1), d)),
        r"\S+/model.safetensors.index.json does not match its shards: it puts \S+ in "
        r"model-00003-of-00003.safetensors, the shards hold it in model-00001",
    ),
]


def _index_moving_a_tensor(folder: Path) -> Path:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(k for k, v in index["weight_map"].items() if v == "model-00001-of-00003.safetensors")
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize("make, message", [u[1:] for u in UNREADABLE], ids=[u[0] for u in UNREADABLE])
def test_an_unreadable_source_is_named_in_the_error(tmp_path, make, message):
    with pytest.raises(CheckpointError, match=message):
        load_initial_weights(unsharded_model(), make(tmp_path))
