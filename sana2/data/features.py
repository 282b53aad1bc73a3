"""The feature format training reads: its specification and its reader.

On-disk format ("sana2-features", version 1)
============================================

A dataset is one directory::

    my_dataset/
        meta.json
        shard_00000.safetensors
        shard_00001.safetensors
        ...

meta.json is a JSON object with these fields:

    "format"          "sana2-features" (exactly)
    "version"         1 (exactly)
    "num_samples"     N, a positive integer: the sum of the shards' sample counts
    "latent_shape"    [C, H, W] (images) or [C, T, H, W] (video): one sample's latent, positive integers
    "caption_length"  L, a positive integer: tokens per caption (the model's model_max_length)
    "caption_dim"     C_cap, a positive integer: width of a token embedding (the model's caption_channels)
    "shards"          non-empty list of shard file names, relative to the directory, in sample order:
                      sample i of the dataset is found by counting through the shards in this order
    "captions"        optional: null, or a list of N strings (the caption text of each sample, for
                      logging and evaluation; training reads only the embeddings)
    "metadata"        optional: any JSON value, free for the producer (sana2 records build parameters there)

Each shard is a safetensors file holding exactly these tensors, all with the same leading size n >= 1:

    "latents"         [n, *latent_shape], float32, bfloat16 or float16. What the diffusion model is trained
                      to generate, already scaled: e.g. DC-AE latents multiplied by its scaling factor
                      (0.41407 for DC-AE f32c32), or pixels mapped to [-1, 1]. No further scaling is applied.
    "caption_embeds"  [n, L, C_cap], float32, bfloat16 or float16: the text encoder's last hidden state per
                      token, including padding positions (as Sana computes them).
    "caption_mask"    [n, L], any integer dtype or bool, values 0/1: 1 for the caption's real tokens,
                      0 for padding.

Other tensors in a shard are ignored. `sana2.data.writer.write_feature_dataset` produces this
layout; `FeatureDataset` checks all of it on open and raises `DataFormatError` naming the file, the
field and what was expected. Shards are read through memory maps, so a dataset may be larger than
memory.
"""

import bisect
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

FORMAT_NAME = "sana2-features"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TENSOR_NAMES = ("latents", "caption_embeds", "caption_mask")
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MASK_DTYPES = {"BOOL", "U8", "I8", "I16", "I32", "I64"}


class DataFormatError(ValueError):
    """A dataset directory that does not follow the sana2-features format."""


class FeatureDataset:
    """A validated sana2-features dataset; `get_batch` gathers samples by global index."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = _read_meta(self.path)
        self.captions: list[str] | None = self.meta.get("captions")
        self.metadata = self.meta.get("metadata")
        self.latent_shape = tuple(self.meta["latent_shape"])
        self.caption_length = self.meta["caption_length"]
        self.caption_dim = self.meta["caption_dim"]
        self._handles = []  # open safetensors files, kept alive for their slices
        self._shards = []  # per shard: {tensor name: safetensors slice}, read lazily through the mmap
        shard_sizes = []
        for name in self.meta["shards"]:
            handle, slices, size = _open_shard(self.path / name, self.meta)
            self._handles.append(handle)
            self._shards.append(slices)
            shard_sizes.append(size)
        total = sum(shard_sizes)
        if total != self.meta["num_samples"]:
            raise DataFormatError(
                f"{self.path / META_FILE}: field 'num_samples' is {self.meta['num_samples']}, "
                f"but the shards hold {total} samples"
            )
        self._shard_starts = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]

    def __len__(self) -> int:
        return self.meta["num_samples"]

    def get_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """latents [b, *latent_shape], caption_embeds [b, 1, L, C_cap], caption_mask [b, L], all float32."""
        if len(indices) == 0:
            raise ValueError("get_batch needs at least one sample index")
        rows = {name: [] for name in TENSOR_NAMES}
        for index in indices:
            shard, local = self._locate(int(index))
            for name in TENSOR_NAMES:
                rows[name].append(self._shards[shard][name][local : local + 1])
        latents = torch.cat(rows["latents"]).float()
        caption_embeds = torch.cat(rows["caption_embeds"]).float()
        caption_mask = torch.cat(rows["caption_mask"]).long()
        if not ((caption_mask == 0) | (caption_mask == 1)).all():
            raise DataFormatError(
                f"{self.path}: 'caption_mask' of samples {list(indices)} holds values other than 0 and 1"
            )
        # the model takes captions as [B, 1, L, C]
        return {"latents": latents, "caption_embeds": caption_embeds.unsqueeze(1), "caption_mask": caption_mask.float()}

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples in {self.path}")
        shard = bisect.bisect_right(self._shard_starts, index) - 1
        return shard, index - self._shard_starts[shard]


def _read_meta(path: Path) -> dict:
    if not path.is_dir():
        raise DataFormatError(f"{path}: dataset directory does not exist")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise DataFormatError(f"{meta_path}: missing; a sana2-features dataset needs {META_FILE}")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataFormatError(f"{meta_path}: not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise DataFormatError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    _check_meta_fields(meta_path, meta)
    return meta


def _check_meta_fields(meta_path: Path, meta: dict) -> None:
    def fail(field, expected):
        shown = _describe(meta[field]) if field in meta else "missing"
        raise DataFormatError(f"{meta_path}: field '{field}' is {shown}; expected {expected}")

    def positive_int(value):
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    if meta.get("format") != FORMAT_NAME:
        fail("format", repr(FORMAT_NAME))
    if meta.get("version") != FORMAT_VERSION or isinstance(meta.get("version"), bool):
        fail("version", FORMAT_VERSION)
    if not positive_int(meta.get("num_samples")):
        fail("num_samples", "a positive integer")
    shape = meta.get("latent_shape")
    if not (isinstance(shape, list) and len(shape) in (3, 4) and all(positive_int(d) for d in shape)):
        fail("latent_shape", "[C, H, W] or [C, T, H, W] of positive integers")
    for field in ("caption_length", "caption_dim"):
        if not positive_int(meta.get(field)):
            fail(field, "a positive integer")
    shards = meta.get("shards")
    if not (isinstance(shards, list) and shards and all(_is_plain_file_name(s) for s in shards)):
        fail("shards", "a non-empty list of file names inside the dataset directory")
    captions = meta.get("captions")
    if captions is not None and not (
        isinstance(captions, list)
        and len(captions) == meta["num_samples"]
        and all(isinstance(c, str) for c in captions)
    ):
        fail("captions", f"null or a list of num_samples={meta['num_samples']} strings")


def _describe(value) -> str:
    """A short rendering of a JSON value for an error message (caption lists can be huge)."""
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"a {type(value).__name__} of {len(value)} items" if isinstance(value, (list, dict)) else text[:77] + "..."


def _is_plain_file_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _open_shard(shard_path: Path, meta: dict):
    """Open one shard and check its tensors against meta.json: (handle, {name: slice}, sample count)."""
    if not shard_path.is_file():
        raise DataFormatError(f"{shard_path}: shard listed in {META_FILE} 'shards' is missing")
    try:
        handle = safe_open(shard_path, framework="pt")
        present = set(handle.keys())
        slices = {name: handle.get_slice(name) for name in TENSOR_NAMES if name in present}
    except (SafetensorError, OSError, ValueError) as error:
        raise DataFormatError(f"{shard_path}: not a readable safetensors file ({error})") from None
    for name in TENSOR_NAMES:
        if name not in slices:
            raise DataFormatError(f"{shard_path}: missing tensor '{name}' (found: {sorted(present) or 'none'})")
    size = slices["latents"].get_shape()[0] if slices["latents"].get_shape() else 0
    expected = {
        "latents": [size, *meta["latent_shape"]],
        "caption_embeds": [size, meta["caption_length"], meta["caption_dim"]],
        "caption_mask": [size, meta["caption_length"]],
    }
    for name in TENSOR_NAMES:
        shape = list(slices[name].get_shape())
        if shape != expected[name] or size == 0:
            raise DataFormatError(
                f"{shard_path}: tensor '{name}' has shape {shape}; expected {expected[name]} "
                f"(n >= 1 samples, shapes from {META_FILE})"
            )
        dtype = slices[name].get_dtype()
        allowed = MASK_DTYPES if name == "caption_mask" else set(FLOAT_DTYPES)
        if dtype not in allowed:
            raise DataFormatError(f"{shard_path}: tensor '{name}' has dtype {dtype}; expected one of {sorted(allowed)}")
    return handle, slices, size
