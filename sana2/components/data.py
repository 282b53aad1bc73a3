"""Training data: pre-computed features on disk, a deterministic resumable loader, and the digits set.

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

Other tensors in a shard are ignored. `write_feature_dataset` produces this layout; `FeatureDataset`
checks all of it on open and raises `DataFormatError` naming the file, the field and what was expected.
Shards are read through memory maps, so a dataset may be larger than memory.
"""

import bisect
import csv
import gzip
import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

FORMAT_NAME = "sana2-features"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TENSOR_NAMES = ("latents", "caption_embeds", "caption_mask")
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MASK_DTYPES = {"BOOL", "U8", "I8", "I16", "I32", "I64"}


class DataFormatError(ValueError):
    """A dataset directory that does not follow the sana2-features format."""


# ----------------------------------------------------------------------------------------------
# Writing


def write_feature_dataset(
    out_dir: str | Path,
    latents: torch.Tensor,
    caption_embeds: torch.Tensor,
    caption_mask: torch.Tensor,
    captions: list[str] | None = None,
    shard_size: int = 1024,
    metadata=None,
    overwrite: bool = False,
) -> Path:
    """Write a sana2-features dataset to `out_dir` and return its path.

    The dataset is assembled in a temporary sibling directory and renamed into place, so `out_dir` is
    either absent or complete. Tensors are stored in their given dtypes (the mask as int64).
    An existing `out_dir` is an error unless `overwrite`.
    """
    out_dir = Path(out_dir)
    num_samples = _check_write_inputs(latents, caption_embeds, caption_mask, captions, shard_size)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        shard_names = []
        for shard_index, start in enumerate(range(0, num_samples, shard_size)):
            end = min(start + shard_size, num_samples)
            name = f"shard_{shard_index:05d}.safetensors"
            save_file(
                {
                    "latents": latents[start:end].contiguous(),
                    "caption_embeds": caption_embeds[start:end].contiguous(),
                    "caption_mask": caption_mask[start:end].to(torch.int64).contiguous(),
                },
                staging / name,
            )
            shard_names.append(name)
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "num_samples": num_samples,
            "latent_shape": list(latents.shape[1:]),
            "caption_length": caption_embeds.shape[1],
            "caption_dim": caption_embeds.shape[2],
            "shards": shard_names,
            "captions": list(captions) if captions is not None else None,
        }
        if metadata is not None:
            meta["metadata"] = metadata
        (staging / META_FILE).write_text(json.dumps(meta, indent=1))
        _make_readable(staging)
        _move_into_place(staging, out_dir, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _check_write_inputs(latents, caption_embeds, caption_mask, captions, shard_size) -> int:
    if latents.dim() not in (4, 5):
        raise ValueError(f"latents must be [N, C, H, W] or [N, C, T, H, W], got shape {tuple(latents.shape)}")
    if caption_embeds.dim() != 3:
        raise ValueError(f"caption_embeds must be [N, L, C_cap], got shape {tuple(caption_embeds.shape)}")
    num_samples, length = caption_embeds.shape[:2]
    if latents.shape[0] != num_samples or num_samples == 0:
        raise ValueError(
            f"latents hold {latents.shape[0]} samples and caption_embeds {num_samples}; they must agree and be non-zero"
        )
    if tuple(caption_mask.shape) != (num_samples, length):
        raise ValueError(f"caption_mask must be [{num_samples}, {length}], got {tuple(caption_mask.shape)}")
    for name, tensor in (("latents", latents), ("caption_embeds", caption_embeds)):
        if tensor.dtype not in FLOAT_DTYPES.values():
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {tensor.dtype}")
    if caption_mask.is_floating_point() or not torch.isin(caption_mask.long(), torch.tensor([0, 1])).all():
        raise ValueError("caption_mask must hold integer 0/1 values")
    if captions is not None and (len(captions) != num_samples or not all(isinstance(c, str) for c in captions)):
        raise ValueError(f"captions must be a list of {num_samples} strings")
    if shard_size < 1:
        raise ValueError(f"shard_size must be positive, got {shard_size}")
    return num_samples


def _make_readable(directory: Path) -> None:
    """Give a dataset ordinary permissions: temporary directories and files start private to their owner."""
    directory.chmod(0o755)
    for child in directory.iterdir():
        if child.is_dir():
            _make_readable(child)
        else:
            child.chmod(0o644)


def _move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    if not (overwrite and out_dir.exists()):
        os.rename(staging, out_dir)
        return
    # rename the old dataset aside first so that out_dir is never a half-replaced mix of both
    _retire(out_dir)
    os.rename(staging, out_dir)


# ----------------------------------------------------------------------------------------------
# Reading


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


# ----------------------------------------------------------------------------------------------
# Loading for distributed training


class DistributedFeatureLoader:
    """Deterministic, resumable batches for data-parallel training with gradient accumulation.

    Every optimizer step consumes G = local_batch_size * dp_world_size * grad_accum_steps consecutive
    entries of the epoch's permutation. Micro-batch m of rank r is the slice starting at
    position + m * (local_batch_size * dp_world_size) + r * local_batch_size. The state (epoch, position)
    counts global samples, so a run resumed at another data-parallel size with the same G sees the same
    global samples in the same steps.
    """

    def __init__(
        self, dataset, local_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_world_size: int, seed: int
    ):
        if min(local_batch_size, grad_accum_steps, dp_world_size) < 1:
            raise ValueError("local_batch_size, grad_accum_steps and dp_world_size must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.global_batch_size = local_batch_size * dp_world_size * grad_accum_steps
        self.num_samples = len(dataset)
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (local {local_batch_size} x dp {dp_world_size} x "
                f"grad accumulation {grad_accum_steps})"
            )
        self.steps_per_epoch = self.num_samples // self.global_batch_size
        self.samples_per_epoch = self.steps_per_epoch * self.global_batch_size
        self.epoch = 0
        self.position = 0  # samples of this epoch consumed by all ranks together
        self._cached_permutation: tuple[int, torch.Tensor] | None = None

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of `epoch`, identical on every rank and at every world size."""
        if self._cached_permutation is None or self._cached_permutation[0] != epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._cached_permutation = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._cached_permutation[1]

    def step_indices(self) -> list[torch.Tensor]:
        """This rank's sample ids for each micro-batch of the next step (does not advance)."""
        order = self.permutation(self.epoch)
        micro_stride = self.local_batch_size * self.dp_world_size
        starts = [
            self.position + m * micro_stride + self.dp_rank * self.local_batch_size
            for m in range(self.grad_accum_steps)
        ]
        return [order[start : start + self.local_batch_size].clone() for start in starts]

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches for one optimizer step, then advance."""
        micro_batches = []
        for indices in self.step_indices():
            batch = self.dataset.get_batch(indices.tolist())
            batch["indices"] = indices
            micro_batches.append(batch)
        self.position += self.global_batch_size
        if self.position + self.global_batch_size > self.num_samples:
            # too few samples left for a full step: drop them and start the next epoch
            self.epoch += 1
            self.position = 0
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved_batch = state["global_batch_size"]
        if saved_batch != self.global_batch_size:
            raise ValueError(
                f"data loader state was saved with global batch size {saved_batch}, but this run uses "
                f"{self.global_batch_size} (local {self.local_batch_size} x dp {self.dp_world_size} x grad "
                f"accumulation {self.grad_accum_steps}); resuming needs the same global batch size"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or position % saved_batch or position + saved_batch > self.num_samples:
            raise ValueError(
                f"data loader state epoch={epoch} position={position} does not fit a dataset of "
                f"{self.num_samples} samples with global batch size {saved_batch}"
            )
        self.epoch, self.position = epoch, position


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch), so neighbouring seeds/epochs give unrelated orders."""
    digest = hashlib.sha256(f"sana2-loader/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


# ----------------------------------------------------------------------------------------------
# The embedded default data: 8x8 handwritten digits


DIGITS_SOURCE = "digits.csv.gz"
DIGITS_BUILDER_VERSION = 1
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Short on purpose: the tiny byte-level encoder spends one token per character and SanaMS_digits reads
# 16 tokens (15 characters + end of sequence), so every phrasing must fit in 15 characters to keep
# the digit visible after truncation.
DIGIT_CAPTIONS = ("digit {word}", "the number {digit}", "a drawn {word}", "handwritten {digit}", "{word}, by hand")


def digit_caption(label: int, sample_index: int) -> str:
    """The caption of digits sample `sample_index` (its phrasing cycles with the index)."""
    template = DIGIT_CAPTIONS[sample_index % len(DIGIT_CAPTIONS)]
    return template.format(word=NUMBER_WORDS[label], digit=label)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The 1797 digits as pixels float32 [N, 1, 8, 8] in [-1, 1] (row-major) and labels int64 [N]."""
    with (
        resources.files("sana2.data").joinpath(DIGITS_SOURCE).open("rb") as raw,
        gzip.open(raw, "rt", newline="") as text,
    ):
        rows = [[int(value) for value in row] for row in csv.reader(text) if row]
    table = torch.tensor(rows, dtype=torch.int64)
    if table.shape[1] != 65:
        raise DataFormatError(f"{DIGITS_SOURCE}: expected 64 pixel columns and a label, got {table.shape[1]} columns")
    pixels = table[:, :64].float() / 16.0 * 2.0 - 1.0  # source pixels count 0..16 "on" cells
    return pixels.view(-1, 1, 8, 8), table[:, 64]


def build_digits_dataset(
    root: str | Path, encoder_name: str = "tiny-t5", max_length: int = 16, val_size: int = 97
) -> tuple[Path, Path]:
    """Build (or reuse) the digits train/validation datasets under `root`; return (train_dir, val_dir).

    The build parameters name the cache directory root/digits-<hash> and are recorded in each meta.json;
    a complete cache with the same parameters is reused. The whole cache directory appears with one
    rename, so concurrent callers never see a partial one (the loser of a race discards its copy).
    Note a local encoder directory is identified by its path: rebuild by deleting the cache if its
    weights change.
    """
    root = Path(root)
    params = {
        "builder_version": DIGITS_BUILDER_VERSION,
        "source": DIGITS_SOURCE,
        "encoder": str(encoder_name),
        "max_length": max_length,
        "val_size": val_size,
        "captions": list(DIGIT_CAPTIONS),
    }
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    cache = root / f"digits-{key}"
    train_dir, val_dir = cache / "train", cache / "val"
    if _is_complete_digits_cache(train_dir, val_dir, params):
        return train_dir, val_dir
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}.tmp-", dir=root))
    try:
        _write_digits(staging, encoder_name, max_length, val_size, params)
        _make_readable(staging)
        try:
            os.rename(staging, cache)
        except OSError:  # the cache directory exists
            if not _is_complete_digits_cache(train_dir, val_dir, params):
                # damaged leftovers (a concurrent builder's finished copy would have been complete)
                _retire(cache)
                os.rename(staging, cache)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return train_dir, val_dir


def _retire(directory: Path) -> None:
    """Rename `directory` aside, then delete it, so that its name is free at once."""
    retired = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
    try:
        os.rename(directory, retired / directory.name)
    except FileNotFoundError:
        pass  # another process retired it first
    shutil.rmtree(retired, ignore_errors=True)


def _write_digits(out: Path, encoder_name: str, max_length: int, val_size: int, params: dict) -> None:
    from sana2.components.text_encoder import build_text_encoder

    pixels, labels = load_digits()
    if not 0 < val_size < len(labels):
        raise ValueError(f"val_size must be between 1 and {len(labels) - 1}, got {val_size}")
    captions = [digit_caption(int(label), i) for i, label in enumerate(labels)]
    # few distinct captions: encode each once, then gather
    distinct = sorted(set(captions))
    embeds, masks = build_text_encoder(encoder_name, max_length).encode(distinct)
    row_of = {caption: row for row, caption in enumerate(distinct)}
    rows = torch.tensor([row_of[c] for c in captions])
    caption_embeds, caption_mask = embeds[rows], masks[rows]
    split = len(labels) - val_size  # the last val_size samples validate
    for name, part in (("train", slice(0, split)), ("val", slice(split, None))):
        write_feature_dataset(
            out / name,
            pixels[part],
            caption_embeds[part],
            caption_mask[part],
            captions=captions[part],
            metadata={**params, "split": name, "labels": labels[part].tolist()},
        )


def _is_complete_digits_cache(train_dir: Path, val_dir: Path, params: dict) -> bool:
    for split, directory in (("train", train_dir), ("val", val_dir)):
        try:
            metadata = FeatureDataset(directory).metadata
        except DataFormatError:
            return False
        if (
            not isinstance(metadata, dict)
            or {k: metadata.get(k) for k in params} != params
            or metadata.get("split") != split
        ):
            return False
    return True
