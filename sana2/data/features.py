"""The feature format training reads: its specification (versions 1 and 2) and its one reader.

On-disk format ("sana2-features")
=================================

A dataset is one directory::

    my_dataset/
        meta.json                       written last: a folder without it is not a dataset (yet)
        shard_00000.safetensors
        shard_00001.safetensors ...
        null_caption.safetensors        version 2, optional: the empty prompt's embedding
        skipped.jsonl                   optional, informative: inputs sana2-prepare did not use, one JSON
                                        object {"source", "reason"} per line

Version 1 holds one latent shape for the whole dataset (the digits; `sana2.data.writer.write_feature_dataset`
writes it from tensors in memory). Version 2 holds samples of several latent shapes, the aspect-ratio
buckets of images of several shapes: every shard holds the samples of ONE bucket, so each tensor in a
shard is dense and a sample's latent shape is its shard's bucket's (`sana2-prepare` writes it, shard by
shard). `FeatureDataset` reads both.

meta.json is a JSON object. Fields of both versions:

    "format"          "sana2-features" (exactly)
    "version"         1 or 2
    "num_samples"     N, a positive integer: the sum of the shards' sample counts
    "caption_length"  L, a positive integer: tokens per caption (the model's model_max_length)
    "caption_dim"     C_cap, a positive integer: width of a token embedding (the model's caption_channels)
    "metadata"        optional: any JSON value, free for the producer (sana2 records build parameters there)

Version 1 only:

    "latent_shape"    [C, H, W] (images) or [C, T, H, W] (video): one sample's latent, positive integers
    "shards"          non-empty list of shard file names, relative to the directory, in sample order:
                      sample i of the dataset is found by counting through the shards in this order
    "captions"        optional: null, or a list of N strings (the caption text of each sample, for
                      logging and evaluation; training reads only the embeddings)

Version 2 only:

    "buckets"         non-empty list; bucket b is entry b:
                        "name"          its ratio key as Sana's tables write it (height / width), e.g. "0.57"
                        "image_size"    [H, W] in pixels: what images of this bucket were resized and cropped to
                        "latent_shape"  [C, h, w] (or [C, T, h, w]): one sample's latent, positive integers
                        "num_samples"   samples of this bucket over all shards
    "shards"          non-empty list, in sample order; each entry:
                        "file"          a file name inside the dataset folder
                        "bucket"        index into "buckets"
                        "num_samples"   n >= 1, the leading size of the shard's tensors
    "null_caption"    the file name of the null caption (below), or null

Each shard is a safetensors file holding these tensors, all with the same leading size n >= 1:

    "latents"         [n, *latent_shape], float32, bfloat16 or float16. What the diffusion model is trained
                      to generate, already scaled: e.g. DC-AE latents multiplied by its scaling factor
                      ((z - shift) * scaling_factor; 0.41407 for DC-AE f32c32), or pixels mapped to [-1, 1].
                      No further scaling is applied.
    "caption_embeds"  [n, L, C_cap], float32, bfloat16 or float16: the text encoder's last hidden state per
                      token, including padding positions (as Sana computes them).
    "caption_mask"    [n, L], any integer dtype or bool, values 0/1: 1 for the caption's real tokens,
                      0 for padding.

A shard's safetensors metadata (string -> string) records the tensors' checksums, as sana2's writers write
it (both versions, and the null caption below):

    "sana2_crc32"     JSON object {tensor name: CRC32 of its bytes as stored} (sana2/formats/checksums.py,
                      the check checkpoints use too). `FeatureDataset` checks a shard's tensors against it
                      the first time it reads a sample of that shard, not when it opens the dataset (start-up
                      stays a read of headers however big the dataset; the cost is one more pass over each
                      shard's bytes, at its first use), and a mismatch is a DataFormatError naming the shard
                      and the tensor. A shard without the entry (written by an earlier sana2) is read
                      unchecked: FeatureDataset says once, when it opens the dataset, how many there are.

A version-2 shard also carries, in its safetensors metadata (string -> string):

    "sana2_keys"      JSON list of the n sample keys (unique in the dataset; see sana2/data/sources.py)
    "sana2_captions"  JSON list of the n caption texts that were encoded
    "sana2_bucket"    the bucket's name
    "sana2_skipped"   optional: JSON list of [source, reason] of the inputs planned for this shard that could
                      not be encoded (sana2-prepare gathers them into skipped.jsonl)

null_caption.safetensors holds "caption_embeds" [L, C_cap] and "caption_mask" [L]: the embedding of the
empty prompt, which training stores in the model's null caption (`y_embedder.y_embedding`) for
classifier-free dropout, so that every checkpoint carries it.

Other tensors and metadata entries are ignored. `FeatureDataset` checks all of the above when it opens a
dataset and raises `DataFormatError` naming the file, the field and what was expected. Shards are read
through memory maps, so a dataset may be larger than memory. The writers are in sana2/data/writer.py.
"""

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from sana2.formats.checksums import recorded_checksums, stored_checksum_error
from sana2.log import logger

FORMAT_NAME = "sana2-features"
SINGLE_SHAPE_VERSION = 1
BUCKETED_VERSION = 2
META_FILE = "meta.json"
NULL_CAPTION_FILE = "null_caption.safetensors"
SKIP_REPORT_FILE = "skipped.jsonl"
TENSOR_NAMES = ("latents", "caption_embeds", "caption_mask")
FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MASK_DTYPES = {"BOOL", "U8", "I8", "I16", "I32", "I64"}
# the name of a version-1 dataset's one bucket
SINGLE_BUCKET = "all"
REPREPARE = "the file changed after it was written (disk or copy damage): prepare the dataset again"


class DataFormatError(ValueError):
    """A dataset directory that does not follow the sana2-features format."""


def shard_file_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def bucket_entry(name: str, image_size, latent_shape, num_samples: int) -> dict:
    """One entry of meta.json's "buckets" (also what FeatureDataset and OnlineDataset list as `buckets`)."""
    image_size = None if image_size is None else list(image_size)
    return {"name": name, "image_size": image_size, "latent_shape": list(latent_shape), "num_samples": num_samples}


def batch_bucket(bucket_ids: torch.Tensor, indices) -> int:
    """The one bucket the samples `indices` all come from (a batch has one latent shape); ValueError otherwise."""
    if len(indices) == 0:
        raise ValueError("get_batch needs at least one sample index")
    buckets = {int(bucket_ids[int(index)]) for index in indices}
    if len(buckets) != 1:
        raise ValueError(f"a batch must come from one bucket; samples {list(indices)} span buckets {buckets}")
    return buckets.pop()


def most_common_latent_shape(buckets: list[dict]) -> tuple[int, ...]:
    """The latent shape of the bucket (a `bucket_entry`) with the most samples, the first of equals: what a run
    trains at most, and what its validation samples at."""
    counts = [bucket["num_samples"] for bucket in buckets]
    return tuple(buckets[counts.index(max(counts))]["latent_shape"])


def read_buckets(path: str | Path) -> list[dict]:
    """A dataset folder's buckets (`bucket_entry`s) from its meta.json alone, without opening a shard."""
    return _buckets_of(_read_meta(Path(path)))


def _buckets_of(meta: dict) -> list[dict]:
    if meta["version"] == SINGLE_SHAPE_VERSION:
        return [bucket_entry(SINGLE_BUCKET, None, meta["latent_shape"], meta["num_samples"])]
    return meta["buckets"]


class FeatureDataset:
    """A validated sana2-features dataset (either version); `get_batch` gathers samples by global index.

    Both versions look alike here: `buckets` (one for version 1, named "all"), each sample's bucket in
    `bucket_ids`, each bucket's latent shape in `latent_shapes`.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = _read_meta(self.path)
        self.version = self.meta["version"]
        self.metadata = self.meta.get("metadata")
        self.caption_length = self.meta["caption_length"]
        self.caption_dim = self.meta["caption_dim"]
        self.buckets = _buckets_of(self.meta)
        if self.version == SINGLE_SHAPE_VERSION:
            entries = [{"file": name, "bucket": 0, "num_samples": None} for name in self.meta["shards"]]
        else:
            entries = self.meta["shards"]
        self.latent_shapes = [tuple(bucket["latent_shape"]) for bucket in self.buckets]
        self.captions: list[str] | None = self.meta.get("captions") if self.version == 1 else []
        self.keys: list[str] | None = None if self.version == 1 else []
        self._handles = []  # open safetensors files, kept alive for their slices
        self._shards = []  # per shard: {tensor name: safetensors slice}, read lazily through the mmap
        self._shard_paths = []
        self._checksums = []  # per shard: {tensor name: CRC32} its writer recorded, or None (written without)
        self._checked = set()  # the shards whose bytes were checked against their CRC32 (on first use)
        self._shard_starts, bucket_ids = [], []
        for entry in entries:
            shard_path = self.path / entry["file"]
            handle, slices, size = _open_shard(
                shard_path, self.latent_shapes[entry["bucket"]], self.caption_length, self.caption_dim, entry
            )
            if self.version == BUCKETED_VERSION:
                info = _shard_metadata(shard_path, handle.metadata() or {}, size)
                if info["bucket"] != self.buckets[entry["bucket"]]["name"]:
                    raise DataFormatError(
                        f"{shard_path}: holds bucket {info['bucket']!r}, {META_FILE} lists "
                        f"{self.buckets[entry['bucket']]['name']!r}"
                    )
                self.keys += info["keys"]
                self.captions += info["captions"]
            self._handles.append(handle)
            self._shards.append(slices)
            self._shard_paths.append(shard_path)
            self._checksums.append(_shard_checksums(shard_path, handle))
            self._shard_starts.append(len(bucket_ids))
            bucket_ids += [entry["bucket"]] * size
        if len(bucket_ids) != self.meta["num_samples"]:
            raise DataFormatError(
                f"{self.path / META_FILE}: field 'num_samples' is {self.meta['num_samples']}, "
                f"but the shards hold {len(bucket_ids)} samples"
            )
        self.bucket_ids = torch.tensor(bucket_ids, dtype=torch.int64)
        unchecked = sum(checksums is None for checksums in self._checksums)
        if unchecked:  # a dataset of an earlier sana2: still read, once said
            logger.warning(
                f"{self.path}: {unchecked} of {len(entries)} shards carry no CRC32 (written before sana2 "
                "recorded them); their bytes are not checked when read"
            )

    def __len__(self) -> int:
        return self.meta["num_samples"]

    def latent_shape_of(self, index: int) -> tuple[int, ...]:
        """Sample `index`'s latent shape (its bucket's)."""
        return self.latent_shapes[int(self.bucket_ids[index])]

    def get_batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """latents [b, *latent_shape], caption_embeds [b, 1, L, C_cap], caption_mask [b, L], all float32.

        All samples must be of one bucket (a batch has one latent shape).
        """
        batch_bucket(self.bucket_ids, indices)
        located = [self._locate(int(index)) for index in indices]
        for shard in sorted({shard for shard, _ in located}):
            self._check_shard(shard)
        rows = {
            name: [self._shards[shard][name][local : local + 1] for shard, local in located] for name in TENSOR_NAMES
        }
        latents = torch.cat(rows["latents"]).float()
        caption_embeds = torch.cat(rows["caption_embeds"]).float()
        caption_mask = torch.cat(rows["caption_mask"]).long()
        bad = ~((caption_mask == 0) | (caption_mask == 1)).all(dim=1)
        if bad.any():
            row = int(torch.nonzero(bad)[0])
            raise DataFormatError(
                f"{self._shard_paths[located[row][0]]}: 'caption_mask' of sample {indices[row]} (row "
                f"{located[row][1]} of the shard) holds values other than 0 and 1"
            )
        # the model takes captions as [B, 1, L, C]
        return {"latents": latents, "caption_embeds": caption_embeds.unsqueeze(1), "caption_mask": caption_mask.float()}

    def null_caption(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeds float32 [L, C_cap], mask int64 [L]) of the empty prompt, if the dataset has it."""
        name = self.meta.get("null_caption")
        if name is None:
            return None
        path = self.path / name
        try:
            with safe_open(path, framework="pt") as handle:
                embeds, mask = handle.get_tensor("caption_embeds"), handle.get_tensor("caption_mask")
                checksums = _shard_checksums(path, handle)
                damage = checksums and stored_checksum_error(handle, checksums, ("caption_embeds", "caption_mask"))
        except (SafetensorError, OSError) as error:
            raise DataFormatError(f"{path}: not a readable null caption ({error})") from None
        if damage:
            raise DataFormatError(f"{path}: {damage}; {REPREPARE}")
        expected = (self.caption_length, self.caption_dim)
        if tuple(embeds.shape) != expected or tuple(mask.shape) != expected[:1]:
            raise DataFormatError(
                f"{path}: null caption of shape {tuple(embeds.shape)} / mask {tuple(mask.shape)}; expected "
                f"{list(expected)} / [{self.caption_length}]"
            )
        return embeds.float(), mask.long()

    def check_all_shards(self) -> int:
        """Check every shard's bytes now rather than at its first read (for small datasets sana2 builds and
        reuses itself); returns how many shards carry no CRC32 to check against."""
        for shard in range(len(self._shards)):
            self._check_shard(shard)
        return sum(checksums is None for checksums in self._checksums)

    def _check_shard(self, shard: int) -> None:
        """The bytes of shard `shard`'s tensors against their CRC32, the first time the shard is read."""
        if shard in self._checked:
            return
        checksums = self._checksums[shard]
        path = self._shard_paths[shard]
        try:
            damage = checksums and stored_checksum_error(self._handles[shard], checksums, TENSOR_NAMES)
        except (SafetensorError, OSError) as error:
            raise DataFormatError(f"{path}: not a readable safetensors file ({error})") from None
        if damage:
            raise DataFormatError(f"{path}: {damage}; {REPREPARE}")
        self._checked.add(shard)

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples in {self.path}")
        shard = bisect.bisect_right(self._shard_starts, index) - 1
        return shard, index - self._shard_starts[shard]


# ----------------------------------------------------------------------------------------------
# meta.json


def _read_meta(path: Path) -> dict:
    if not path.is_dir():
        raise DataFormatError(f"{path}: dataset directory does not exist")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise DataFormatError(
            f"{meta_path}: missing; a sana2-features dataset needs {META_FILE} (an unfinished one lacks it)"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataFormatError(f"{meta_path}: not valid JSON ({error})") from None
    check_meta(meta_path, meta)
    return meta


def check_meta(meta_path: Path, meta) -> None:
    """Raise DataFormatError naming the first field of `meta` (either version) that breaks the spec."""

    def fail(field, expected):
        shown = _describe(meta[field]) if field in meta else "missing"
        raise DataFormatError(f"{meta_path}: field '{field}' is {shown}; expected {expected}")

    if not isinstance(meta, dict):
        raise DataFormatError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT_NAME:
        fail("format", repr(FORMAT_NAME))
    version = meta.get("version")
    if version not in (SINGLE_SHAPE_VERSION, BUCKETED_VERSION) or isinstance(version, bool):
        fail("version", f"{SINGLE_SHAPE_VERSION} or {BUCKETED_VERSION}")
    for name in ("num_samples", "caption_length", "caption_dim"):
        if not _positive_int(meta.get(name)):
            fail(name, "a positive integer")
    if version == SINGLE_SHAPE_VERSION:
        _check_single_shape_fields(meta, fail)
    else:
        _check_bucketed_fields(meta, fail)


def _check_single_shape_fields(meta: dict, fail) -> None:
    shape = meta.get("latent_shape")
    if not (isinstance(shape, list) and len(shape) in (3, 4) and all(_positive_int(d) for d in shape)):
        fail("latent_shape", "[C, H, W] or [C, T, H, W] of positive integers")
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


def _check_bucketed_fields(meta: dict, fail) -> None:
    buckets = meta.get("buckets")
    if not (isinstance(buckets, list) and buckets and all(_is_bucket(b) for b in buckets)):
        fail("buckets", 'a non-empty list of {"name", "image_size": [H, W], "latent_shape", "num_samples"}')
    shards = meta.get("shards")
    if not (isinstance(shards, list) and shards and all(_is_shard(s, len(buckets)) for s in shards)):
        fail("shards", 'a non-empty list of {"file", "bucket": an index into buckets, "num_samples" >= 1}')
    total = sum(s["num_samples"] for s in shards)
    if total != meta["num_samples"]:
        fail("num_samples", f"the sum of the shards' num_samples ({total})")
    for index, bucket in enumerate(buckets):
        in_shards = sum(s["num_samples"] for s in shards if s["bucket"] == index)
        if in_shards != bucket["num_samples"]:
            fail("buckets", f"bucket {index} num_samples = its shards' total ({in_shards})")
    if meta.get("null_caption") is not None and not _is_plain_file_name(meta["null_caption"]):
        fail("null_caption", "null or a file name inside the dataset folder")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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


def _describe(value) -> str:
    """A short rendering of a JSON value for an error message (caption lists can be huge)."""
    text = repr(value)
    if len(text) <= 80:
        return text
    return f"a {type(value).__name__} of {len(value)} items" if isinstance(value, (list, dict)) else text[:77] + "..."


def _is_plain_file_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


# ----------------------------------------------------------------------------------------------
# Shards


def _open_shard(shard_path: Path, latent_shape: tuple, caption_length: int, caption_dim: int, entry: dict):
    """Open one shard and check its tensors against meta.json: (handle, {name: slice}, sample count).

    `entry["num_samples"]` is the count meta.json states (version 2), or None (version 1: any n >= 1).
    """
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
    stated = entry["num_samples"]
    size = stated if stated is not None else (slices["latents"].get_shape() or [0])[0]
    expected = {
        "latents": [size, *latent_shape],
        "caption_embeds": [size, caption_length, caption_dim],
        "caption_mask": [size, caption_length],
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


def _shard_checksums(path: Path, handle) -> dict[str, int] | None:
    """The CRC32 per tensor a shard's writer recorded; None for a shard of an earlier sana2, which recorded none."""
    try:
        return recorded_checksums(handle.metadata())
    except ValueError as error:
        raise DataFormatError(f"{path}: {error}") from None


def _shard_metadata(path: Path, metadata: dict[str, str], num_samples: int) -> dict:
    """A version-2 shard's keys, captions and bucket name, checked against its sample count."""
    try:
        keys, captions = json.loads(metadata["sana2_keys"]), json.loads(metadata["sana2_captions"])
        bucket = metadata["sana2_bucket"]
    except (KeyError, ValueError) as error:
        raise DataFormatError(f"{path}: metadata 'sana2_keys', 'sana2_captions', 'sana2_bucket' missing or bad") from (
            error
        )
    if not (isinstance(keys, list) and isinstance(captions, list) and len(keys) == len(captions) == num_samples):
        raise DataFormatError(
            f"{path}: metadata lists {len(keys)} keys and {len(captions)} captions for {num_samples} samples"
        )
    return {"keys": keys, "captions": captions, "bucket": bucket}


@dataclass(frozen=True)
class ShardInfo:
    """What a written version-2 shard holds, read from its header and metadata without loading tensors."""

    num_samples: int
    keys: list[str]
    captions: list[str]
    bucket: str
    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    metadata: dict[str, str]


def read_shard_info(path: Path) -> ShardInfo:
    """The header of a version-2 shard as sana2-prepare wrote it (n may be 0: every image of it failed)."""
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
    n = shapes["latents"][0] if shapes["latents"] else -1
    if not all(shape and shape[0] == n for shape in shapes.values()):
        raise DataFormatError(f"{path}: tensors of shapes {shapes}; all leading sizes must agree")
    info = _shard_metadata(path, metadata, n)
    return ShardInfo(n, info["keys"], info["captions"], info["bucket"], shapes, dtypes, metadata)
