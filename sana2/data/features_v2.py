"""Bucketed features on disk ("sana2-features", version 2): samples of several latent shapes.

Version 1 (sana2/data/features.py) holds one latent shape for the whole dataset. Version 2 adds
aspect-ratio buckets: each shard holds the samples of ONE bucket, so every tensor in a shard is dense
and a sample's latent shape is its shard's bucket's. `sana2-prepare` writes it.

Layout
======

    my_dataset/
        meta.json                       written last: a folder without it is not a dataset (yet)
        null_caption.safetensors        the empty prompt through the same text encoder
        shard_00000.safetensors ...     one bucket each
        skipped.jsonl                   inputs that were not used, one JSON object per line (informative)

meta.json, a JSON object:

    "format"          "sana2-features" (exactly)
    "version"         2 (exactly)
    "num_samples"     N > 0: the sum of the listed shards' sample counts
    "caption_length"  L > 0: tokens per caption
    "caption_dim"     C_cap > 0: width of a token embedding
    "buckets"         non-empty list; bucket b is entry b:
                        "name"          its ratio key as Sana's tables write it (height / width), e.g. "0.57"
                        "image_size"    [H, W] in pixels: what images of this bucket were resized and cropped to
                        "latent_shape"  [C, h, w] (or [C, T, h, w]): one sample's latent, positive integers
                        "num_samples"   samples of this bucket over all shards
    "shards"          non-empty list, in sample order (sample i of the dataset is found by counting through
                      the shards in this order); each entry:
                        "file"          a file name inside the dataset folder
                        "bucket"        index into "buckets"
                        "num_samples"   n >= 1, the leading size of the shard's tensors
    "null_caption"    the file name of the null caption (below), or null
    "metadata"        optional: any JSON value, free for the producer (sana2-prepare records its encoders,
                      their settings and the input paths there)

Each shard is a safetensors file with these tensors, all of leading size n:

    "latents"         [n, *latent_shape of its bucket], float32, bfloat16 or float16, already scaled as the
                      diffusion model consumes them (e.g. (z - shift) * scaling_factor; DC-AE f32c32: z * 0.41407)
    "caption_embeds"  [n, L, C_cap], float32, bfloat16 or float16: the text encoder's last hidden state per
                      token (padding positions included, as Sana computes them)
    "caption_mask"    [n, L], an integer dtype or bool, values 0/1 (1: a real token)

and in its safetensors metadata (string -> string):

    "sana2_keys"      JSON list of the n sample keys (unique in the dataset; see sana2/data/sources.py)
    "sana2_captions"  JSON list of the n caption texts that were encoded
    "sana2_bucket"    the bucket's name
    "sana2_skipped"   optional: JSON list of [source, reason] of the inputs planned for this shard that could
                      not be encoded (sana2-prepare gathers them into skipped.jsonl)

null_caption.safetensors holds "caption_embeds" [L, C_cap] and "caption_mask" [L]: the embedding of the
empty prompt, which training stores in the model's null caption (`y_embedder.y_embedding`) for
classifier-free dropout, so that every checkpoint carries it.

Other tensors and metadata entries are ignored. `FeatureDatasetV2` checks all of the above when it
opens a dataset and raises DataFormatError naming the file, the field and what was expected.
"""

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sana2.data.features import FLOAT_DTYPES, MASK_DTYPES, META_FILE, DataFormatError, _is_plain_file_name
from sana2.staging import staged

FORMAT_NAME = "sana2-features"
FORMAT_VERSION = 2
NULL_CAPTION_FILE = "null_caption.safetensors"
SKIP_REPORT_FILE = "skipped.jsonl"
TENSOR_NAMES = ("latents", "caption_embeds", "caption_mask")


def shard_file_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


# ----------------------------------------------------------------------------------------------
# Writing


def write_shard(
    path: Path,
    latents: torch.Tensor,
    caption_embeds: torch.Tensor,
    caption_mask: torch.Tensor,
    keys: list[str],
    captions: list[str],
    bucket_name: str,
    extra_metadata: dict[str, str] | None = None,
) -> None:
    """Write one shard atomically: `path` appears complete or not at all (an existing one is replaced)."""
    n = len(keys)
    if not (latents.shape[0] == caption_embeds.shape[0] == caption_mask.shape[0] == len(captions) == n):
        raise ValueError(
            f"shard {path}: {n} keys, {len(captions)} captions, latents {tuple(latents.shape)}, caption_embeds "
            f"{tuple(caption_embeds.shape)}, caption_mask {tuple(caption_mask.shape)}: leading sizes must agree"
        )
    metadata = {"sana2_keys": json.dumps(keys), "sana2_captions": json.dumps(captions), "sana2_bucket": bucket_name}
    metadata.update(extra_metadata or {})
    tensors = {
        "latents": latents.contiguous(),
        "caption_embeds": caption_embeds.contiguous(),
        "caption_mask": caption_mask.to(torch.int64).contiguous(),
    }
    with staged(path, replace=True) as temporary:
        save_file(tensors, temporary, metadata=metadata)


def write_null_caption(folder: Path, caption_embeds: torch.Tensor, caption_mask: torch.Tensor) -> None:
    """The empty prompt's embedding [L, C_cap] and mask [L], beside the shards."""
    if caption_embeds.dim() != 2 or tuple(caption_mask.shape) != (caption_embeds.shape[0],):
        raise ValueError(
            f"null caption must be [L, C_cap] with a mask [L], got {tuple(caption_embeds.shape)} and "
            f"{tuple(caption_mask.shape)}"
        )
    tensors = {"caption_embeds": caption_embeds.contiguous(), "caption_mask": caption_mask.to(torch.int64).contiguous()}
    with staged(folder / NULL_CAPTION_FILE, replace=True) as temporary:
        save_file(tensors, temporary)


def write_meta(folder: Path, meta: dict) -> None:
    """Publish meta.json (last: it marks the dataset complete). `meta` is checked against the spec first."""
    check_meta(folder / META_FILE, meta)
    with staged(folder / META_FILE, replace=True) as temporary:
        temporary.write_text(json.dumps(meta, indent=1))


@dataclass(frozen=True)
class ShardInfo:
    """What a written shard holds, read from its header and metadata without loading tensors."""

    num_samples: int
    keys: list[str]
    captions: list[str]
    bucket: str
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    metadata: dict[str, str]


def read_shard_info(path: Path) -> ShardInfo:
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            present = set(handle.keys())
            missing = [name for name in TENSOR_NAMES if name not in present]
            if missing:
                raise DataFormatError(f"{path}: missing tensor(s) {missing} (found: {sorted(present) or 'none'})")
            slices = {name: handle.get_slice(name) for name in TENSOR_NAMES}
            shapes = {name: list(s.get_shape()) for name, s in slices.items()}
            dtypes = {name: s.get_dtype() for name, s in slices.items()}
    except (SafetensorError, OSError) as error:
        raise DataFormatError(f"{path}: not a readable safetensors file ({error})") from None
    try:
        keys, captions = json.loads(metadata["sana2_keys"]), json.loads(metadata["sana2_captions"])
        bucket = metadata["sana2_bucket"]
    except (KeyError, ValueError) as error:
        raise DataFormatError(f"{path}: metadata 'sana2_keys', 'sana2_captions', 'sana2_bucket' missing or bad") from (
            error
        )
    n = shapes["latents"][0] if shapes["latents"] else -1
    if not (len(keys) == len(captions) == n and all(shape and shape[0] == n for shape in shapes.values())):
        raise DataFormatError(
            f"{path}: {len(keys)} keys and {len(captions)} captions, tensors of shapes {shapes}; "
            "all leading sizes must agree"
        )
    return ShardInfo(n, keys, captions, bucket, shapes, dtypes, metadata)


# ----------------------------------------------------------------------------------------------
# Checking and reading


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_meta(meta_path: Path, meta) -> None:
    """Raise DataFormatError naming the first field of `meta` that breaks the spec."""

    def fail(field, expected):
        shown = json.dumps(meta.get(field))[:80] if field in meta else "missing"
        raise DataFormatError(f"{meta_path}: field '{field}' is {shown}; expected {expected}")

    if not isinstance(meta, dict):
        raise DataFormatError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        fail("format", repr(FORMAT_NAME))
    if meta.get("version") != FORMAT_VERSION or isinstance(meta.get("version"), bool):
        fail("version", FORMAT_VERSION)
    for name in ("num_samples", "caption_length", "caption_dim"):
        if not _positive_int(meta.get(name)):
            fail(name, "a positive integer")
    buckets = meta.get("buckets")
    if not (isinstance(buckets, list) and buckets and all(_is_bucket(b) for b in buckets)):
        fail("buckets", 'a non-empty list of {"name", "image_size": [H, W], "latent_shape", "num_samples"}')
    shards = meta.get("shards")
    if not (isinstance(shards, list) and shards and all(_is_shard(s, len(buckets)) for s in shards)):
        fail("shards", 'a non-empty list of {"file", "bucket": an index into buckets, "num_samples" >= 1}')
    if sum(s["num_samples"] for s in shards) != meta["num_samples"]:
        fail("num_samples", f"the sum of the shards' num_samples ({sum(s['num_samples'] for s in shards)})")
    for index, bucket in enumerate(buckets):
        in_shards = sum(s["num_samples"] for s in shards if s["bucket"] == index)
        if in_shards != bucket["num_samples"]:
            fail("buckets", f"bucket {index} num_samples = its shards' total ({in_shards})")
    if meta.get("null_caption") is not None and not _is_plain_file_name(meta["null_caption"]):
        fail("null_caption", "null or a file name inside the dataset folder")


def _is_bucket(bucket) -> bool:
    return (
        isinstance(bucket, dict)
        and isinstance(bucket.get("name"), str)
        and isinstance(bucket.get("image_size"), list)
        and len(bucket["image_size"]) == 2
        and all(_positive_int(d) for d in bucket["image_size"])
        and isinstance(bucket.get("latent_shape"), list)
        and len(bucket["latent_shape"]) in (3, 4)
        and all(_positive_int(d) for d in bucket["latent_shape"])
        and isinstance(bucket.get("num_samples"), int)
        and bucket["num_samples"] >= 0
    )


def _is_shard(shard, num_buckets: int) -> bool:
    return (
        isinstance(shard, dict)
        and _is_plain_file_name(shard.get("file"))
        and isinstance(shard.get("bucket"), int)
        and 0 <= shard["bucket"] < num_buckets
        and _positive_int(shard.get("num_samples"))
    )


class FeatureDatasetV2:
    """A validated version-2 dataset: per-sample buckets, and batches gathered from one bucket."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            raise DataFormatError(f"{meta_path}: missing; the dataset is incomplete or not a sana2-features dataset")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            raise DataFormatError(f"{meta_path}: not valid JSON ({error})") from None
        check_meta(meta_path, self.meta)
        self.caption_length, self.caption_dim = self.meta["caption_length"], self.meta["caption_dim"]
        self.buckets = self.meta["buckets"]
        self._handles, self._slices, starts, bucket_ids, self.keys, self.captions = [], [], [], [], [], []
        for entry in self.meta["shards"]:
            shard = self.path / entry["file"]
            if not shard.is_file():
                raise DataFormatError(f"{shard}: shard listed in {META_FILE} 'shards' is missing")
            info = read_shard_info(shard)
            self._check_shard(shard, info, entry)
            handle = safe_open(shard, framework="pt")
            self._handles.append(handle)
            self._slices.append({name: handle.get_slice(name) for name in TENSOR_NAMES})
            starts.append(len(bucket_ids))
            bucket_ids += [entry["bucket"]] * info.num_samples
            self.keys += info.keys
            self.captions += info.captions
        self._shard_starts = starts
        self.bucket_ids = torch.tensor(bucket_ids, dtype=torch.int64)

    def _check_shard(self, shard: Path, info: ShardInfo, entry: dict) -> None:
        bucket = self.buckets[entry["bucket"]]
        n = entry["num_samples"]
        expected = {
            "latents": [n, *bucket["latent_shape"]],
            "caption_embeds": [n, self.caption_length, self.caption_dim],
            "caption_mask": [n, self.caption_length],
        }
        for name, shape in expected.items():
            if info.shapes[name] != shape:
                raise DataFormatError(
                    f"{shard}: tensor '{name}' has shape {info.shapes[name]}; expected {shape} (from {META_FILE})"
                )
            allowed = MASK_DTYPES if name == "caption_mask" else set(FLOAT_DTYPES)
            if info.dtypes[name] not in allowed:
                raise DataFormatError(f"{shard}: tensor '{name}' has dtype {info.dtypes[name]}; expected {allowed}")
        if info.bucket != bucket["name"]:
            raise DataFormatError(f"{shard}: holds bucket {info.bucket!r}, {META_FILE} lists {bucket['name']!r}")

    def __len__(self) -> int:
        return self.meta["num_samples"]

    def latent_shape(self, index: int) -> tuple[int, ...]:
        return tuple(self.buckets[int(self.bucket_ids[index])]["latent_shape"])

    def get_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """latents [b, *latent_shape], caption_embeds [b, 1, L, C_cap], caption_mask [b, L], all float32.

        All samples must be of one bucket (a batch has one latent shape).
        """
        if len(indices) == 0:
            raise ValueError("get_batch needs at least one sample index")
        buckets = {int(self.bucket_ids[i]) for i in indices}
        if len(buckets) != 1:
            raise ValueError(f"a batch must come from one bucket; samples {list(indices)} span buckets {buckets}")
        rows = {name: [] for name in TENSOR_NAMES}
        for index in indices:
            shard = bisect.bisect_right(self._shard_starts, int(index)) - 1
            local = int(index) - self._shard_starts[shard]
            for name in TENSOR_NAMES:
                rows[name].append(self._slices[shard][name][local : local + 1])
        mask = torch.cat(rows["caption_mask"]).long()
        if not ((mask == 0) | (mask == 1)).all():
            raise DataFormatError(f"{self.path}: 'caption_mask' of samples {list(indices)} holds values other than 0/1")
        return {
            "latents": torch.cat(rows["latents"]).float(),
            "caption_embeds": torch.cat(rows["caption_embeds"]).float().unsqueeze(1),
            "caption_mask": mask.float(),
        }

    def null_caption(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeds float32 [L, C_cap], mask int64 [L]) of the empty prompt, if the dataset has it."""
        name = self.meta.get("null_caption")
        if name is None:
            return None
        path = self.path / name
        try:
            with safe_open(path, framework="pt") as handle:
                embeds, mask = handle.get_tensor("caption_embeds"), handle.get_tensor("caption_mask")
        except (SafetensorError, OSError) as error:
            raise DataFormatError(f"{path}: not a readable null caption ({error})") from None
        if tuple(embeds.shape) != (self.caption_length, self.caption_dim) or tuple(mask.shape) != (
            self.caption_length,
        ):
            raise DataFormatError(
                f"{path}: null caption of shape {tuple(embeds.shape)} / mask {tuple(mask.shape)}; expected "
                f"[{self.caption_length}, {self.caption_dim}] / [{self.caption_length}]"
            )
        return embeds.float(), mask.long()
