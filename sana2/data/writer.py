"""Write datasets in the feature format (specified in sana2/data/features.py).

`write_feature_dataset` writes a version-1 dataset from tensors in memory, all at once. A version-2
dataset is written piece by piece (sana2-prepare encodes shard after shard, on several ranks):
`write_shard` for each shard, `write_null_caption`, and `write_meta` last, which makes it a dataset.
Every safetensors file they write records its tensors' CRC32 in its metadata (sana2/formats/checksums.py).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sana2.data.features import (
    FLOAT_DTYPES,
    FORMAT_NAME,
    META_FILE,
    NULL_CAPTION_FILE,
    SINGLE_SHAPE_VERSION,
    SKIP_REPORT_FILE,
    check_meta,
    shard_file_name,
)
from sana2.formats.checksums import checksum_metadata
from sana2.staging import ensure_free_space, reporting_full_disk, staged


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

    The dataset appears in one rename once complete (sana2.staging), so `out_dir` is either absent,
    the previous dataset, or the whole new one. Tensors are stored in their given dtypes (the mask
    as int64). An existing `out_dir` is an error unless `overwrite`; too little free disk space is
    a NoSpaceError, before anything is written or when the disk fills meanwhile (nothing is left).
    """
    out_dir = Path(out_dir)
    num_samples = _check_write_inputs(latents, caption_embeds, caption_mask, captions, shard_size)
    mask = caption_mask.to(torch.int64)
    needed = latents.nbytes + caption_embeds.nbytes + mask.nbytes
    ensure_free_space(out_dir, needed)
    with reporting_full_disk(out_dir, needed), staged(out_dir, replace=overwrite) as staging:
        staging.mkdir()
        shard_names = []
        for shard_index, start in enumerate(range(0, num_samples, shard_size)):
            end = min(start + shard_size, num_samples)
            name = shard_file_name(shard_index)
            tensors = _shard_tensors(latents[start:end], caption_embeds[start:end], mask[start:end])
            save_file(tensors, staging / name, metadata=checksum_metadata(tensors))
            shard_names.append(name)
        meta = {
            "format": FORMAT_NAME,
            "version": SINGLE_SHAPE_VERSION,
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
    """Write one version-2 shard atomically: `path` appears complete or not at all (an existing one is replaced)."""
    n = len(keys)
    if not (latents.shape[0] == caption_embeds.shape[0] == caption_mask.shape[0] == len(captions) == n):
        raise ValueError(
            f"shard {path}: {n} keys, {len(captions)} captions, latents {tuple(latents.shape)}, caption_embeds "
            f"{tuple(caption_embeds.shape)}, caption_mask {tuple(caption_mask.shape)}: leading sizes must agree"
        )
    metadata = {"sana2_keys": json.dumps(keys), "sana2_captions": json.dumps(captions), "sana2_bucket": bucket_name}
    metadata.update(extra_metadata or {})
    tensors = _shard_tensors(latents, caption_embeds, caption_mask)
    metadata.update(checksum_metadata(tensors))
    with reporting_full_disk(path, sum(t.nbytes for t in tensors.values())), staged(path, replace=True) as temporary:
        save_file(tensors, temporary, metadata=metadata)


def write_null_caption(folder: Path, caption_embeds: torch.Tensor, caption_mask: torch.Tensor) -> None:
    """The empty prompt's embedding [L, C_cap] and mask [L], beside the shards."""
    if caption_embeds.dim() != 2 or tuple(caption_mask.shape) != (caption_embeds.shape[0],):
        raise ValueError(
            f"null caption must be [L, C_cap] with a mask [L], got {tuple(caption_embeds.shape)} and "
            f"{tuple(caption_mask.shape)}"
        )
    tensors = {"caption_embeds": caption_embeds.contiguous(), "caption_mask": caption_mask.to(torch.int64).contiguous()}
    path = folder / NULL_CAPTION_FILE
    with reporting_full_disk(path, sum(t.nbytes for t in tensors.values())), staged(path, replace=True) as temporary:
        save_file(tensors, temporary, metadata=checksum_metadata(tensors))


def write_skip_report(folder: Path, skipped: list[dict]) -> None:
    """skipped.jsonl: one {"source": ..., "reason": ...} per input left out (sana2-prepare's and online mode's;
    online mode appends those it finds in training, with "found": TRAINING_SKIP)."""
    folder.mkdir(parents=True, exist_ok=True)
    with staged(folder / SKIP_REPORT_FILE, replace=True) as temporary:
        temporary.write_text("".join(json.dumps(s) + "\n" for s in skipped))


TRAINING_SKIP = "in training"  # "found" of a skip-report entry online mode appends during training


def append_skip_report(folder: Path, entry: dict) -> None:
    """Add one entry to skipped.jsonl (online mode, an input that went bad during training), unless it is
    there already (another rank, an earlier epoch or submission found it)."""
    if entry in _report_entries(folder):
        return
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / SKIP_REPORT_FILE, "a") as report:
        report.write(json.dumps(entry) + "\n")  # one write of one line: ranks appending at once stay whole lines


def training_skips(folder: Path) -> list[dict]:
    """The entries of skipped.jsonl appended in training (kept when the report is written again at start-up)."""
    return [entry for entry in _report_entries(folder) if entry.get("found") == TRAINING_SKIP]


def _report_entries(folder: Path) -> list[dict]:
    try:
        lines = (folder / SKIP_REPORT_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut short by a kill: the rest still counts
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def write_meta(folder: Path, meta: dict) -> None:
    """Publish meta.json (last: it marks the dataset complete). `meta` is checked against the spec first."""
    check_meta(folder / META_FILE, meta)
    with staged(folder / META_FILE, replace=True) as temporary:
        temporary.write_text(json.dumps(meta, indent=1))


def _shard_tensors(latents, caption_embeds, caption_mask) -> dict[str, torch.Tensor]:
    return {
        "latents": latents.contiguous(),
        "caption_embeds": caption_embeds.contiguous(),
        "caption_mask": caption_mask.to(torch.int64).contiguous(),
    }
