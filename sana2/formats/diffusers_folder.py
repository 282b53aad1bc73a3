"""diffusers model folders of Sana transformers, read and written one tensor at a time.

A folder holds diffusers' `config.json` and `diffusion_pytorch_model.safetensors` (or numbered
shards and `diffusion_pytorch_model.safetensors.index.json`), which
`SanaTransformer2DModel.from_pretrained(folder)` (or `SanaVideoTransformer3DModel`) loads. sana2
adds one file diffusers does not read: `sana2_null_caption.safetensors`, the model's null caption
(`y_embedder.y_embedding`), which diffusers' format has no place for (its pipelines encode the
empty prompt instead). With it, a model goes sana2 -> diffusers -> sana2 whole; Sana's released
folders do not have it.

The tensor names, splits and configs are sana2/formats/diffusers.py's; here they are applied to
files: writing turns each sana2 tensor into its diffusers pieces (each a range of its dim-0 rows,
read on its own), reading joins the pieces of each sana2 tensor back (a range of its rows reads
only the pieces that hold them).
"""

import json
import re
from pathlib import Path
from typing import Any

import torch

from sana2.cli import CONFIG_JSON
from sana2.formats.diffusers import (
    IMAGE_CLASS,
    INDEX_NAME,
    VIDEO_CLASS,
    WEIGHTS_NAME,
    DiffusersFormatError,
    Piece,
    check_diffusers_names,
    export_pieces,
    import_sources,
    sana2_model,
    source_rows,
)
from sana2.formats.safetensors_file import (
    SUFFIX,
    read_safetensors,
    read_safetensors_checkpoint,
    write_safetensors,
    write_safetensors_folder,
)
from sana2.formats.tensors import CheckpointError, SourceTensor, check_shapes, first_line
from sana2.models.registry import build_model

STEM = WEIGHTS_NAME.removesuffix(SUFFIX)  # "diffusion_pytorch_model"
NULL_CAPTION_NAME = "sana2_null_caption.safetensors"
NULL_CAPTION_KEY = "y_embedder.y_embedding"
POS_EMBED_KEY = "pos_embed"
# a variant's files (diffusers' from_pretrained(variant="bf16")): diffusion_pytorch_model.bf16.safetensors
_VARIANT = re.compile(rf"{STEM}\.(\w+){re.escape(SUFFIX)}(\.index\.json)?")


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json if it describes one of diffusers' Sana transformers, else None."""
    try:
        config = json.loads((Path(folder) / CONFIG_JSON).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("_class_name") in (IMAGE_CLASS, VIDEO_CLASS):
        return config
    return None


def config_problem(folder: Path) -> str | None:
    """What keeps a folder holding diffusers' weight files from being read as one: its config.json
    missing, unreadable, not JSON, or describing another model; None if there is none to name."""
    folder = Path(folder)
    if not any(_VARIANT.fullmatch(p.name) or p.name in (WEIGHTS_NAME, INDEX_NAME) for p in folder.iterdir()):
        return None  # not laid out as a diffusers model folder
    path = folder / CONFIG_JSON
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return f"{path} is missing (a diffusers model folder describes its model there)"
    except OSError as exc:
        return f"{path} cannot be read: {exc.strerror or exc}"
    except ValueError as exc:
        return f"{path} is not valid JSON ({exc})"
    kind = config.get("_class_name") if isinstance(config, dict) else None
    if kind not in (IMAGE_CLASS, VIDEO_CLASS):
        return f"{path} describes {kind!r}, not a Sana transformer ({IMAGE_CLASS} or {VIDEO_CLASS})"
    return None


def is_diffusers_folder(path: Path) -> bool:
    return Path(path).is_dir() and read_config(path) is not None


def _weights_stem(folder: Path) -> str:
    """The stem of the folder's weight files: diffusers' standard one, else its only variant."""
    if (folder / INDEX_NAME).is_file() or (folder / WEIGHTS_NAME).is_file():
        return STEM
    variants = sorted({match.group(1) for p in folder.iterdir() if (match := _VARIANT.fullmatch(p.name))})
    if len(variants) == 1:
        return f"{STEM}.{variants[0]}"
    found = f"variants {', '.join(variants)}" if variants else "no weights"
    raise CheckpointError(f"diffusers folder {folder}: expected {WEIGHTS_NAME} or {INDEX_NAME}, found {found}")


def _joined(name: str, pieces: list[SourceTensor]) -> SourceTensor:
    """The sana2 tensor `name` whose dim-0 rows are `pieces` one after another (equal pieces)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first.renamed(name)
    odd = [p.name for p in pieces if p.shape[1:] != first.shape[1:] or p.shape[0] != first.shape[0]]
    odd += [p.name for p in pieces if p.dtype != first.dtype]
    if odd:
        raise CheckpointError(f"{name}: its diffusers pieces differ in shape or dtype ({', '.join(sorted(set(odd)))})")
    rows = first.shape[0] * len(pieces)
    by_name = {p.name: p for p in pieces}

    def fill(out: torch.Tensor, start: int) -> None:
        at = 0
        for piece, begin, end in source_rows(list(by_name), rows, start, start + out.shape[0]):
            by_name[piece].read_into(out[at : at + end - begin], begin)
            at += end - begin

    return SourceTensor(name, (rows, *first.shape[1:]), first.dtype, fill)


def read_diffusers_folder(folder: str | Path) -> list[SourceTensor]:
    """The sana2 model tensors of a diffusers folder, named and ordered as the model's state dict.

    `pos_embed` (never read by the forward) is the model's own value, computed; the null caption
    comes from sana2's file when the folder has one, and is absent otherwise.
    """
    folder = Path(folder)
    config = read_config(folder)
    if config is None:
        raise CheckpointError(f"{folder / CONFIG_JSON} does not describe a {IMAGE_CLASS} or {VIDEO_CLASS}")
    try:
        model_name, kwargs = sana2_model(config)
    except (DiffusersFormatError, KeyError) as exc:
        raise CheckpointError(f"{folder / CONFIG_JSON}: {first_line(exc)}") from None
    null = _read_null_caption(folder)
    if null is not None:
        kwargs["model_max_length"] = null.shape[0]
    with torch.device("meta"):
        model = build_model(model_name, **kwargs)
    shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    video = config["_class_name"] == VIDEO_CLASS
    sources = import_sources(shapes, video)
    stored = {t.name: t for t in read_safetensors_checkpoint(folder, _weights_stem(folder))}
    try:
        check_diffusers_names(
            {n for names in sources.values() for n in names}, set(stored), f"diffusers folder {folder}"
        )
    except DiffusersFormatError as exc:
        raise CheckpointError(str(exc)) from None
    tensors = {key: _joined(key, [stored[n] for n in names]) for key, names in sources.items()}
    check_shapes(
        f"diffusers folder {folder}", {k: t.shape for k, t in tensors.items()}, {k: shapes[k] for k in tensors}
    )
    dtype = tensors["x_embedder.proj.weight"].dtype
    tensors[POS_EMBED_KEY] = SourceTensor.of(POS_EMBED_KEY, model.initial_pos_embed().to(dtype))
    if null is not None:
        tensors[NULL_CAPTION_KEY] = null
    return [tensors[key] for key in shapes if key in tensors]


def _read_null_caption(folder: Path) -> SourceTensor | None:
    path = folder / NULL_CAPTION_NAME
    if not path.exists():
        return None
    found = {t.name: t for t in read_safetensors(path)}
    if set(found) != {NULL_CAPTION_KEY} or len(found[NULL_CAPTION_KEY].shape) != 2:
        raise CheckpointError(f"{path} should hold one 2-D tensor {NULL_CAPTION_KEY}, found {', '.join(found)}")
    return found[NULL_CAPTION_KEY]


def piece_tensor(weight: SourceTensor, piece: Piece) -> SourceTensor:
    """Diffusers tensor `piece` of sana2 tensor `weight`: a range of its rows, read on its own."""
    shape = piece.shape(weight.shape)
    offset = piece.index * shape[0]

    def fill(out: torch.Tensor, start: int) -> None:
        weight.read_into(out, offset + start)

    return SourceTensor(piece.name, shape, weight.dtype, fill)


def diffusers_tensors(weights: list[SourceTensor], video: bool) -> list[SourceTensor]:
    """The diffusers tensors of sana2 tensors `weights` (names as the model's state dict), in order."""
    return [piece_tensor(weight, piece) for weight in weights for piece in export_pieces(weight.name, video)]


def write_diffusers_folder(
    folder: Path,
    config: dict[str, Any],
    tensors: list[SourceTensor],
    null_caption: list[SourceTensor],
    metadata: dict[str, str],
    max_shard_bytes: int,
) -> list[Path]:
    """config.json, the diffusers `tensors` (`diffusers_tensors`; one file, or shards and an index above
    `max_shard_bytes`) and sana2's null caption (if given), into the existing `folder`. Returns the
    weight files written."""
    (folder / CONFIG_JSON).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    files = write_safetensors_folder(folder, tensors, metadata, max_shard_bytes, STEM)
    if null_caption:
        write_safetensors(folder / NULL_CAPTION_NAME, null_caption, metadata)
    return files
