"""A user's images and captions: the input layouts `sana2-prepare` reads, as Sana's datasets lay them out.

Three layouts, recognised from the path (see docs/data_preparation.md for the full description):

* An image folder (Sana's image-folder dataset): images (.png .jpg .jpeg .webp, searched recursively, or the
  `img_names` listed in a `meta_data.json` at the top) and beside each `<stem>.<ext>`:
  - `<stem>.txt`: the caption; its first line is the caption type "prompt";
  - `<stem><suffix>.json` for each caption suffix (default: only ""): either Sana's external-caption layout
    `{"<stem>": {"<caption type>": "<text>", ...}}`, one entry per captioner, or a per-sample object such as
    Sana's conversion tools write (`{"prompt": ..., "width": ..., "height": ..., ...}`), whose string values
    are caption types and whose width / height state the image size.
* A JSONL manifest: one JSON object per line with "path" (relative to the manifest's folder, or absolute),
  "caption" (a string) or "captions" (an object of caption type -> text, or a list of texts, one chosen
  uniformly per sample), optional "width" and "height", optional "key".
* Webdataset .tar shards (Sana's multi-scale web dataset): a .tar file, or a folder of them (the shards
  listed in its `wids-meta.json` "shardlist", else every .tar below it). Members sharing a key (the member
  path up to the first "." of its file name) form a sample: an image (.png .jpg .jpeg .webp), a .json whose
  string values are caption types and whose "width" / "height" give the image size, optionally a .txt
  ("prompt"). Beside shard `<name>.tar`, `<name><suffix>.json` files hold more captions keyed by sample key;
  as in Sana, an entry that has a "prompt" is stored as caption type `<suffix>` (dots replaced by "_"), any
  other entry is merged as it is.

Which caption a sample trains with is chosen per sample with Sana's caption proportions
({caption type: weight}, default {"prompt": 1}): a weighted draw from a generator seeded by (seed, sample
key), falling back to "prompt" when the drawn type is absent, as Sana does. Everything that makes a sample
unusable (a missing or empty caption, an unreadable side file, a bad manifest line, an unreadable tar) is
returned as a Skip naming the file and the reason, never raised and never dropped silently.
"""

import json
import random
import tarfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sana2.seeding import derive_seed

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
DEFAULT_CAPTION_TYPE = "prompt"
WIDS_META = "wids-meta.json"
FOLDER_META = "meta_data.json"


@dataclass(frozen=True)
class ImageLocation:
    """Where an image's bytes are: a whole file, or `length` bytes at `offset` of a tar shard."""

    path: str
    offset: int = 0
    length: int = -1  # -1: the whole file
    member: str = ""  # the tar member, for reports

    def read(self) -> bytes:
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            return file.read(self.length)

    def describe(self) -> str:
        return f"{self.path}:{self.member}" if self.member else self.path


@dataclass(frozen=True)
class Sample:
    """One image and its captions. `key` is unique among the inputs and seeds the caption choice."""

    key: str
    image: ImageLocation
    captions: dict[str, str | None]
    size: tuple[int, int] | None = None  # (width, height), where the input states it
    uniform_captions: bool = False  # a manifest's list of captions: any one, chosen uniformly


@dataclass(frozen=True)
class Skip:
    """An input that is not used, and why."""

    source: str
    reason: str


@dataclass
class Listing:
    samples: list[Sample] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)

    def extend(self, other: "Listing") -> None:
        self.samples += other.samples
        self.skipped += other.skipped


def list_inputs(paths: list[str | Path], caption_suffixes: tuple[str, ...] = ("",)) -> Listing:
    """Every sample of every input path (folder, .jsonl manifest, .tar shard or folder of shards), in order."""
    layouts = [
        (lambda path: path.is_file() and path.suffix == ".jsonl", manifest_listing),
        (
            lambda path: path.is_file() and path.suffix == ".tar",
            lambda path, prefix: _tar_shards([path], path.parent, caption_suffixes, prefix),
        ),
        (
            lambda path: path.is_dir() and ((path / WIDS_META).is_file() or any(path.glob("*.tar"))),
            lambda path, prefix: _tar_shards(_shard_list(path), path, caption_suffixes, prefix),
        ),
        (Path.is_dir, lambda path, prefix: _image_folder(path, caption_suffixes, prefix)),
    ]
    return list_layouts(paths, layouts, "an image folder, a .jsonl manifest, a .tar shard or a folder of .tar shards")


def list_layouts(paths: list[str | Path], layouts: list[tuple[Callable, Callable]], expected: str) -> Listing:
    """Every sample of every input path, in order: each path is read by the reader of the first layout that
    matches it (`[(matches(path), read(path, key prefix) -> Listing)]`), and keys are made unique."""
    listing = Listing()
    for index, path in enumerate(paths):
        path = Path(path)
        prefix = f"{index}:" if len(paths) > 1 else ""  # keys stay unique across inputs
        read = next((read for matches, read in layouts if matches(path)), None)
        if read is None:
            raise FileNotFoundError(f"input {path}: expected {expected}")
        listing.extend(read(path, prefix))
    return deduplicate_keys(listing)


def deduplicate_keys(listing: Listing) -> Listing:
    """`listing` with every sample whose key an earlier sample has moved to the skipped ones."""
    seen, unique = set(), []
    for sample in listing.samples:
        if sample.key in seen:
            listing.skipped.append(Skip(sample.image.describe(), f"duplicate sample key {sample.key!r}"))
        else:
            seen.add(sample.key)
            unique.append(sample)
    listing.samples = unique
    return listing


def orphan_captions(root: Path, media: set[Path], suffixes: tuple[str, ...], kind: str) -> list[Skip]:
    """Caption files under `root` (`<stem>.txt`, `<stem><suffix>.json`) with no media file (its path without
    the extension in `media`) of that stem beside them: reported, never dropped silently."""
    skipped = []
    for caption in sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".json") and p.is_file()):
        if caption.parent == root and caption.name in (FOLDER_META, WIDS_META):
            continue
        name = caption.name[: -len(caption.suffix)]
        if caption.suffix == ".txt":
            stems = {name}
        else:
            stems = {name[: len(name) - len(suffix)] for suffix in suffixes if name.endswith(suffix)}
        if not any(stem and caption.with_name(stem) in media for stem in stems):
            skipped.append(Skip(str(caption), f"caption file with no {kind} beside it"))
    return skipped


def choose_caption(sample: Sample, proportion: dict[str, float], seed: int) -> tuple[str, str] | Skip:
    """(caption type, text) for `sample`, or the Skip that says why it has no usable caption."""
    rng = random.Random(derive_seed("caption", seed, sample.key))
    present = [kind for kind, text in sample.captions.items() if text is not None]
    if sample.uniform_captions:
        kind = rng.choice(present) if present else DEFAULT_CAPTION_TYPE
    else:
        kinds = list(proportion)
        kind = rng.choices(kinds, weights=[proportion[k] for k in kinds], k=1)[0]
        if kind not in sample.captions:
            kind = DEFAULT_CAPTION_TYPE
    text = sample.captions.get(kind)
    if kind not in sample.captions:
        wanted = ", ".join(sorted(set(proportion) | {DEFAULT_CAPTION_TYPE}))
        return Skip(sample.image.describe(), f"no caption (looked for: {wanted})")
    if text is None or not text.strip():
        return Skip(sample.image.describe(), f"empty caption ({kind!r})")
    return kind, text.strip()


# ---------------------------------------------------------------------------------------------
# Image folder


def _image_folder(root: Path, suffixes: tuple[str, ...], prefix: str) -> Listing:
    listing = Listing()
    meta = root / FOLDER_META
    if meta.is_file():
        try:
            names = json.loads(meta.read_text())["img_names"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{meta}: expected a JSON object with a list 'img_names' ({exc})") from None
        images = [root / name for name in names]
    else:
        images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    for image in images:
        stem = image.with_suffix("")
        key = prefix + stem.relative_to(root).as_posix()
        if not image.is_file():
            listing.skipped.append(Skip(str(image), "image file listed in meta_data.json is missing"))
            continue
        captions: dict[str, str | None] = {}
        size = None
        text_file = stem.with_name(stem.name + ".txt")  # "a.b.png" -> "a.b.txt", as Sana splits the extension
        try:
            if text_file.is_file():
                lines = text_file.read_text(encoding="utf-8").splitlines()
                captions[DEFAULT_CAPTION_TYPE] = lines[0] if lines else ""
            for suffix in suffixes:
                side = stem.with_name(stem.name + suffix + ".json")
                if side.is_file():
                    size = _merge_side_file(json.loads(side.read_text(encoding="utf-8")), stem.name, captions) or size
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            listing.skipped.append(Skip(str(image), f"unreadable caption file ({exc})"))
            continue
        listing.samples.append(Sample(key, ImageLocation(str(image)), captions, size))
    listing.skipped += orphan_captions(root, {image.with_suffix("") for image in images}, suffixes, "image")
    return listing


def _merge_side_file(content, stem: str, captions: dict) -> tuple[int, int] | None:
    """Add a side file's captions; return the (width, height) it states, if any."""
    if not isinstance(content, dict):
        raise ValueError(f"expected a JSON object, got {type(content).__name__}")
    entry = content.get(stem)
    if isinstance(entry, dict):  # Sana's external-caption layout, keyed by sample
        captions.update(_caption_values(entry))
        return None
    captions.update(_caption_values(content))  # one sample's own object
    return _stated_size(content)


def _caption_values(entry: dict) -> dict[str, str | None]:
    return {kind: text for kind, text in entry.items() if text is None or isinstance(text, str)}


def _stated_size(info: dict) -> tuple[int, int] | None:
    width, height = info.get("width"), info.get("height")
    if isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0:
        return width, height
    return None


# ---------------------------------------------------------------------------------------------
# JSONL manifest


def manifest_listing(path: Path, prefix: str, read_entry: Callable | None = None) -> Listing:
    """A JSONL manifest's samples, one a line (`read_entry(entry, manifest folder, prefix)`, default
    `manifest_sample`); a line it rejects (ValueError, TypeError) is a Skip naming the line."""
    read_entry = read_entry or manifest_sample
    listing = Listing()
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                listing.samples.append(read_entry(json.loads(line), path.parent, prefix))
            except (ValueError, TypeError) as exc:
                listing.skipped.append(Skip(f"{path}:{number}", f"bad manifest line ({exc})"))
    return listing


def manifest_sample(entry, base: Path, prefix: str) -> Sample:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ValueError('expected an object with a "path" string')
    image = Path(entry["path"])
    image = image if image.is_absolute() else base / image
    if "caption" in entry:
        captions, uniform = {DEFAULT_CAPTION_TYPE: entry["caption"]}, False
    elif isinstance(entry.get("captions"), dict):
        captions, uniform = entry["captions"], False
    elif isinstance(entry.get("captions"), list):
        captions, uniform = {str(i): text for i, text in enumerate(entry["captions"])}, True
    else:
        raise ValueError('expected "caption" (a string) or "captions" (an object or a list)')
    if not all(text is None or isinstance(text, str) for text in captions.values()):
        raise ValueError("captions must be strings")
    size = None
    if "width" in entry or "height" in entry:
        size = _stated_size(entry)
        if size is None:
            raise ValueError('"width" and "height" must both be positive integers')
    key = prefix + str(entry.get("key", entry["path"]))
    return Sample(key, ImageLocation(str(image)), dict(captions), size, uniform)


# ---------------------------------------------------------------------------------------------
# Webdataset tar shards


def _shard_list(root: Path) -> list[Path]:
    meta = root / WIDS_META
    if not meta.is_file():
        return sorted(root.rglob("*.tar"))
    try:
        urls = [entry["url"] for entry in json.loads(meta.read_text())["shardlist"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{meta}: expected a 'shardlist' of objects with a 'url' ({exc})") from None
    return [Path(url) if Path(url).is_absolute() else root / url for url in urls]


def _tar_shards(shards: list[Path], root: Path, suffixes: tuple[str, ...], prefix: str) -> Listing:
    listing = Listing()
    for shard in shards:
        groups, error = _tar_members(shard)
        if error is not None:
            listing.skipped.append(Skip(str(shard), error))
        side_captions = {}
        for suffix in suffixes:
            side = shard.with_name(shard.stem + suffix + ".json")
            if side.is_file():
                try:
                    side_captions[suffix] = json.loads(side.read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError, ValueError) as exc:
                    listing.skipped.append(Skip(str(side), f"unreadable caption file, ignored ({exc})"))
        shard_name = shard.relative_to(root).as_posix() if shard.is_relative_to(root) else str(shard)
        for key, members in groups.items():
            sample = _tar_sample(shard, shard_name, key, members, side_captions, prefix)
            if isinstance(sample, Skip):
                listing.skipped.append(sample)
            else:
                listing.samples.append(sample)
    return listing


def _tar_members(shard: Path) -> tuple[dict[str, dict[str, tuple[str, int, int]]], str | None]:
    """{sample key: {extension: (member name, data offset, size)}} in member order, and any read error.

    A shard that breaks off (truncated, corrupt) keeps the members read before the break.
    """
    groups: dict[str, dict[str, tuple[str, int, int]]] = {}
    try:
        end = shard.stat().st_size
        with tarfile.open(shard, "r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                if member.offset_data + member.size > end:  # tarfile stops quietly at a cut; say so
                    return groups, f"truncated tar shard: {member.name} ends beyond the end of the file"
                folder, _, name = member.name.rpartition("/")
                stem, dot, extension = name.partition(".")
                if not dot:
                    continue
                key = f"{folder}/{stem}" if folder else stem
                groups.setdefault(key, {})[extension.lower()] = (member.name, member.offset_data, member.size)
    except (OSError, tarfile.TarError) as exc:
        return groups, f"unreadable tar shard ({exc})"
    return groups, None


def _tar_sample(shard: Path, shard_name: str, key: str, members: dict, side_captions: dict, prefix: str):
    image_ext = next((ext for ext in ("png", "jpg", "jpeg", "webp") if ext in members), None)
    where = f"{shard}:{key}"
    if image_ext is None:
        return Skip(where, f"no image member (found: {', '.join(sorted(members))})")
    name, offset, length = members[image_ext]
    location = ImageLocation(str(shard), offset, length, name)
    captions: dict[str, str | None] = {}
    size = None
    try:
        if "json" in members:
            info = json.loads(ImageLocation(str(shard), *members["json"][1:]).read())
            if not isinstance(info, dict):
                raise ValueError(f"expected a JSON object, got {type(info).__name__}")
            captions.update(_caption_values(info))
            size = _stated_size(info)
        if "txt" in members and DEFAULT_CAPTION_TYPE not in captions:
            captions[DEFAULT_CAPTION_TYPE] = ImageLocation(str(shard), *members["txt"][1:]).read().decode().strip()
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return Skip(location.describe(), f"unreadable caption member ({exc})")
    for suffix, content in side_captions.items():
        entry = content.get(key) if isinstance(content, dict) else None
        if isinstance(entry, dict):
            if suffix and DEFAULT_CAPTION_TYPE in entry:
                captions[suffix.replace(".", "_")] = entry[DEFAULT_CAPTION_TYPE]
            else:
                captions.update(_caption_values(entry))
    return Sample(f"{prefix}{shard_name}/{key}", location, captions, size)
