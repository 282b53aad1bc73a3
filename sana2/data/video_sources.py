"""A user's clips and captions: the video input layouts `sana2-prepare` and online mode read.

Three layouts, recognised from the path (docs/video.md describes them in full):

* A folder of clips (.mp4 .webm .mov .mkv, searched recursively); beside each `<stem>.<ext>`:
  - `<stem>.txt`: the caption (the whole file, stripped), caption type "prompt";
  - `<stem><suffix>.json` for each caption suffix (default: only ""): a per-clip object (`{"prompt": ...,
    "width": ..., "height": ..., "frames": ..., "fps": ...}`, string values are caption types) or Sana's
    external-caption layout `{"<stem>": {"<caption type>": "<text>", ...}}`.
  A caption file with no clip beside it is reported, not dropped silently.
* A JSONL manifest: one JSON object per line with "path" (relative to the manifest's folder, or absolute),
  "caption" or "captions" (as the image manifest, sana2/data/sources.py), optional "width" and "height",
  "frames" (the clip's frame count) and "fps" (its frame rate), optional "key".
* Sana's zip layout (SanaZipDataset): a .zip file, or a folder of them. Each zip holds `<key>.mp4` and
  `<key>.json` with "height", "width", "frames" and the caption types ("prompt", ...). Beside
  `<name>.zip`, `<name><suffix>.json` files hold more captions keyed by clip key: an entry with a "prompt"
  is stored as caption type `<suffix>` (dots replaced by "_"), any other entry's first value is merged, as
  Sana does. `<name>_unimatch.json` holds Sana's motion scores keyed by clip key (an entry's first value:
  a number, or a list averaged, or its maximum with `motion_score="max"`); the score is appended to every
  caption as Sana appends it: "<caption> motion score: <int(score)>."

Which caption a clip trains with is chosen as for images (`choose_caption`, Sana's caption proportions).
"""

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from sana2.data.sources import (
    DEFAULT_CAPTION_TYPE,
    ImageLocation,
    Listing,
    Sample,
    Skip,
    _caption_values,
    _merge_side_file,
    _stated_size,
    list_inputs,
    list_layouts,
    manifest_listing,
    manifest_sample,
    orphan_captions,
)
from sana2.data.video_decode import VIDEO_EXTENSIONS

MOTION_SCORE_SUFFIX = "_unimatch"
MOTION_SCORE_MODES = ("average", "max", "none")


@dataclass(frozen=True)
class ZipMember:
    """A member of a zip file (read whole: Sana's zips store their clips uncompressed, but need not)."""

    path: str
    member: str

    def read(self) -> bytes:
        with zipfile.ZipFile(self.path) as archive:
            return archive.read(self.member)

    def describe(self) -> str:
        return f"{self.path}:{self.member}"


@dataclass(frozen=True)
class Clip(Sample):
    """A video sample: `image` is where the clip's bytes are; frames and fps where the input states them."""

    frames: int | None = None
    fps: float | None = None


def is_video_input(path: str | Path) -> bool:
    """Whether `path` is one of the video layouts (a zip, a folder of zips or of clips, or a manifest of clips)."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".zip":
            return True
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as lines:
                for line in lines:
                    if line.strip():
                        try:
                            entry = json.loads(line)
                        except ValueError:
                            return False
                        return isinstance(entry, dict) and str(entry.get("path", "")).lower().endswith(VIDEO_EXTENSIONS)
        return False
    if path.is_dir():
        return any(path.glob("*.zip")) or any(
            p.suffix.lower() in VIDEO_EXTENSIONS for p in path.rglob("*") if p.is_file()
        )
    return False


def list_clips(
    paths: list[str | Path], caption_suffixes: tuple[str, ...] = ("",), motion_score: str = "average"
) -> Listing:
    """Every clip of every input path (folder of clips, .jsonl manifest, .zip or folder of zips), in order."""
    if motion_score not in MOTION_SCORE_MODES:
        raise ValueError(f"motion_score must be one of {MOTION_SCORE_MODES}, got {motion_score!r}")
    layouts = [
        (
            lambda path: path.is_file() and path.suffix == ".jsonl",
            lambda path, prefix: manifest_listing(path, prefix, _manifest_clip),
        ),
        (
            lambda path: path.is_file() and path.suffix == ".zip",
            lambda path, prefix: _zips([path], path.parent, caption_suffixes, motion_score, prefix),
        ),
        (
            lambda path: path.is_dir() and any(path.glob("*.zip")),
            lambda path, prefix: _zips(sorted(path.glob("*.zip")), path, caption_suffixes, motion_score, prefix),
        ),
        (Path.is_dir, lambda path, prefix: _clip_folder(path, caption_suffixes, prefix)),
    ]
    return list_layouts(paths, layouts, "a folder of clips, a .jsonl manifest, a .zip or a folder of .zip files")


def list_encoding_inputs(paths: list[str | Path], encoding) -> Listing:
    """The samples of `paths` as an [encoding] section (sana2/config.py's Encoding) reads them: clips where it
    sets num_frames, else images (sana2/data/sources.py's list_inputs)."""
    if not encoding.num_frames:
        return list_inputs(paths, tuple(encoding.caption_suffixes))
    return list_clips(paths, tuple(encoding.caption_suffixes), encoding.motion_score)


# ---------------------------------------------------------------------------------------------
# Folder of clips


def _clip_folder(root: Path, suffixes: tuple[str, ...], prefix: str) -> Listing:
    listing = Listing()
    clips = sorted(p for p in root.rglob("*") if p.suffix.lower() in VIDEO_EXTENSIONS and p.is_file())
    for clip in clips:
        stem = clip.with_suffix("")
        captions: dict[str, str | None] = {}
        info: dict = {}
        text_file = stem.with_name(stem.name + ".txt")
        try:
            if text_file.is_file():
                captions[DEFAULT_CAPTION_TYPE] = text_file.read_text(encoding="utf-8").strip()
            for suffix in suffixes:
                side = stem.with_name(stem.name + suffix + ".json")
                if side.is_file():
                    content = json.loads(side.read_text(encoding="utf-8"))
                    _merge_side_file(content, stem.name, captions)
                    if isinstance(content, dict) and not isinstance(content.get(stem.name), dict):
                        info.update(content)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            listing.skipped.append(Skip(str(clip), f"unreadable caption file ({exc})"))
            continue
        key = prefix + stem.relative_to(root).as_posix()
        listing.samples.append(_clip(key, ImageLocation(str(clip)), captions, info))
    listing.skipped += orphan_captions(root, {p.with_suffix("") for p in clips}, suffixes, "clip")
    return listing


def _clip(key: str, location, captions: dict, info: dict) -> Clip:
    frames, fps = info.get("frames"), info.get("fps")
    frames = int(frames) if isinstance(frames, int | float) and frames > 0 else None
    fps = float(fps) if isinstance(fps, int | float) and fps > 0 else None
    return Clip(key, location, captions, _stated_size(info), frames=frames, fps=fps)


# ---------------------------------------------------------------------------------------------
# JSONL manifest


def _manifest_clip(entry, base: Path, prefix: str) -> Clip:
    sample = manifest_sample(entry, base, prefix)
    for field_name, kind in (("frames", int), ("fps", int | float)):
        value = entry.get(field_name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) or value <= 0):
            raise ValueError(f'"{field_name}" must be a positive number')
    fps = None if entry.get("fps") is None else float(entry["fps"])
    return Clip(**vars(sample), frames=entry.get("frames"), fps=fps)


# ---------------------------------------------------------------------------------------------
# Sana's zip layout


def _zips(zips: list[Path], root: Path, suffixes: tuple[str, ...], motion_score: str, prefix: str) -> Listing:
    listing = Listing()
    for zip_path in zips:
        try:
            with zipfile.ZipFile(zip_path) as archive:
                names = [info.filename for info in archive.infolist() if not info.is_dir()]
                jsons = {name[: -len(".json")]: name for name in names if name.endswith(".json")}
                infos = {key: archive.read(name) for key, name in jsons.items()}
        except (OSError, zipfile.BadZipFile, ValueError) as exc:
            listing.skipped.append(Skip(str(zip_path), f"unreadable zip file ({exc})"))
            continue
        external = _side_files(zip_path, [s for s in suffixes if s], listing)
        scores = _side_files(zip_path, [MOTION_SCORE_SUFFIX], listing) if motion_score != "none" else {}
        zip_name = zip_path.relative_to(root).as_posix() if zip_path.is_relative_to(root) else str(zip_path)
        clip_keys = set()
        for name in names:
            key, dot, extension = name.rpartition(".")
            where = f"{zip_path}:{name}"
            if not dot or name.endswith(".json"):
                continue
            if "." + extension.lower() not in VIDEO_EXTENSIONS:
                reason = "precomputed latents (.npy) are not read" if extension == "npy" else "not a clip"
                listing.skipped.append(Skip(where, f"{reason}; only {', '.join(VIDEO_EXTENSIONS)} members are"))
                continue
            clip_keys.add(key)
            if key not in infos:
                listing.skipped.append(Skip(where, f"no {key}.json beside it in the zip"))
                continue
            try:
                info = json.loads(infos[key])
                if not isinstance(info, dict):
                    raise ValueError(f"expected a JSON object, got {type(info).__name__}")
            except (UnicodeDecodeError, ValueError) as exc:
                listing.skipped.append(Skip(where, f"unreadable {key}.json ({exc})"))
                continue
            captions = _caption_values(info)
            for suffix, content in external.items():
                entry = content.get(key)
                if isinstance(entry, dict) and DEFAULT_CAPTION_TYPE in entry:
                    captions[suffix.replace(".", "_")] = entry[DEFAULT_CAPTION_TYPE]
                elif isinstance(entry, dict) and entry and isinstance(next(iter(entry.values())), dict):
                    captions.update(_caption_values(next(iter(entry.values()))))
            score = _motion_score(scores.get(MOTION_SCORE_SUFFIX, {}).get(key), motion_score)
            if score is not None:
                captions = {
                    kind: f"{text} motion score: {int(score)}." if isinstance(text, str) and text.strip() else text
                    for kind, text in captions.items()
                }
            location = ZipMember(str(zip_path), name)
            listing.samples.append(_clip(f"{prefix}{zip_name}/{key}", location, captions, info))
        for key in sorted(set(infos) - clip_keys):
            listing.skipped.append(Skip(f"{zip_path}:{jsons[key]}", "caption file with no clip beside it"))
    return listing


def _side_files(zip_path: Path, suffixes: list[str], listing: Listing) -> dict[str, dict]:
    found = {}
    for suffix in suffixes:
        side = zip_path.with_name(zip_path.stem + suffix + ".json")
        if side.is_file():
            try:
                content = json.loads(side.read_text(encoding="utf-8"))
                if not isinstance(content, dict):
                    raise ValueError(f"expected a JSON object, got {type(content).__name__}")
                found[suffix] = content
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                listing.skipped.append(Skip(str(side), f"unreadable side file, ignored ({exc})"))
    return found


def _motion_score(entry, mode: str) -> float | None:
    if not isinstance(entry, dict) or not entry:
        return None
    value = next(iter(entry.values()))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, list) and value and all(isinstance(v, int | float) for v in value):
        return max(value) if mode == "max" else sum(value) / len(value)
    return None
