"""The embedded default data: the 1,797 8x8 handwritten digits, captioned and encoded on first use."""

import csv
import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path

import torch

from sana2.data.features import DataFormatError, FeatureDataset
from sana2.data.writer import write_feature_dataset
from sana2.staging import ensure_free_space, reporting_full_disk, staged

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
    a complete cache with the same parameters, every shard matching its CRC32s, is reused (one written before
    shards carried CRC32s, or damaged, is rebuilt: it is small). The whole cache directory appears with one
    rename (sana2.staging), so concurrent callers never see a partial one (the loser of a race
    discards its copy).
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
    pixels, labels, captions, caption_embeds, caption_mask = _encode_digits(encoder_name, max_length)
    needed = pixels.nbytes + caption_embeds.nbytes + caption_mask.to(torch.int64).nbytes
    ensure_free_space(root, needed)
    try:
        # an existing cache here is incomplete (damaged leftovers): it is replaced; a full disk is
        # reported for the data folder, not for the temporary name it met it in
        with reporting_full_disk(root, needed), staged(cache, replace=cache.exists()) as staging:
            staging.mkdir()
            _write_digits(staging, pixels, labels, captions, caption_embeds, caption_mask, val_size, params)
    except FileExistsError:
        # a concurrent builder published first: its complete copy stays, ours was discarded
        if not _is_complete_digits_cache(train_dir, val_dir, params):
            raise
    return train_dir, val_dir


def _encode_digits(encoder_name: str, max_length: int):
    """The digits' pixels, labels, captions and their embeddings and masks."""
    from sana2.encoders.text_encoder import build_text_encoder

    pixels, labels = load_digits()
    captions = [digit_caption(int(label), i) for i, label in enumerate(labels)]
    # few distinct captions: encode each once, then gather
    distinct = sorted(set(captions))
    embeds, masks = build_text_encoder(encoder_name, max_length).encode(distinct)
    row_of = {caption: row for row, caption in enumerate(distinct)}
    rows = torch.tensor([row_of[c] for c in captions])
    return pixels, labels, captions, embeds[rows], masks[rows]


def _write_digits(out: Path, pixels, labels, captions, caption_embeds, caption_mask, val_size: int, params: dict):
    if not 0 < val_size < len(labels):
        raise ValueError(f"val_size must be between 1 and {len(labels) - 1}, got {val_size}")
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
            dataset = FeatureDataset(directory)
            if dataset.check_all_shards():  # written before shards carried CRC32s: rebuilt once, with them
                return False
        except DataFormatError:  # structure or bytes damaged
            return False
        metadata = dataset.metadata
        if (
            not isinstance(metadata, dict)
            or {k: metadata.get(k) for k in params} != params
            or metadata.get("split") != split
        ):
            return False
    return True
