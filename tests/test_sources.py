"""User inputs: image folders with .txt / Sana .json captions, JSONL manifests, webdataset tar shards; the caption
choice by Sana's proportions; image decoding, resizing and cropping as Sana's multi-scale dataset does it."""

import io
import json
import tarfile
from collections import Counter

import pytest
import torch
from encoder_factory import image_bytes
from PIL import Image

from sana2.data.image import BadImage, decode_rgb, image_size, resize_and_crop
from sana2.data.sources import choose_caption, list_inputs


def reasons(listing) -> dict[str, str]:
    return {skip.source.rsplit("/", 1)[-1]: skip.reason for skip in listing.skipped}


# ---------------------------------------------------------------------------------------------
# Image folder


def test_folder_reads_txt_first_lines_and_sana_side_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.png").write_bytes(image_bytes(8, 8))
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "sub" / "b.jpg").write_bytes(image_bytes(8, 8, fmt="JPEG"))
    # Sana's external caption files: <stem><suffix>.json keyed by the stem
    (tmp_path / "sub" / "b_InternVL2-26B.json").write_text(json.dumps({"b": {"InternVL2-26B": "a long caption"}}))
    (tmp_path / "sub" / "b.json").write_text(json.dumps({"prompt": "own prompt", "width": 640, "height": 480}))
    (tmp_path / "c.webp").write_bytes(image_bytes(8, 8, fmt="WEBP"))  # no caption at all
    (tmp_path / "d.v2.png").write_bytes(image_bytes(8, 8))  # only the last extension is the image's
    (tmp_path / "d.v2.txt").write_text("dotted")
    (tmp_path / "notes.md").write_text("not an image")
    listing = list_inputs([tmp_path], caption_suffixes=("", "_InternVL2-26B"))
    samples = {s.key: s for s in listing.samples}
    assert list(samples) == ["a", "c", "d.v2", "sub/b"]  # sorted relative paths
    assert samples["d.v2"].captions == {"prompt": "dotted"}
    assert samples["a"].captions == {"prompt": "first line"} and samples["a"].size is None
    assert samples["sub/b"].captions == {"prompt": "own prompt", "InternVL2-26B": "a long caption"}
    assert samples["sub/b"].size == (640, 480)
    assert samples["c"].captions == {}
    assert choose_caption(samples["c"], {"prompt": 1}, 0).reason == "no caption (looked for: prompt)"


def test_folder_follows_meta_data_json_and_reports_missing_and_broken_files(tmp_path):
    for name in ("x", "y", "z"):
        (tmp_path / f"{name}.png").write_bytes(image_bytes(8, 8))
        (tmp_path / f"{name}.txt").write_text(name)
    (tmp_path / "y.json").write_text("{broken")
    (tmp_path / "meta_data.json").write_text(json.dumps({"name": "toy", "img_names": ["z.png", "y.png", "gone.png"]}))
    listing = list_inputs([tmp_path])
    assert [s.key for s in listing.samples] == ["z"]  # in the listed order, x is not listed
    assert reasons(listing)["y.png"].startswith("unreadable caption file")
    assert reasons(listing)["gone.png"] == "image file listed in meta_data.json is missing"


def test_caption_proportion_draws_per_sample_with_sanas_fallback(tmp_path):
    for i in range(400):
        (tmp_path / f"{i:03d}.png").write_bytes(b"")  # the listing does not read images
        (tmp_path / f"{i:03d}.txt").write_text(f"prompt {i}")
        captions = {"VILA1-5-13B": f"vila {i}"} if i % 2 == 0 else {}
        (tmp_path / f"{i:03d}_VILA1-5-13B.json").write_text(json.dumps({f"{i:03d}": captions}))
    listing = list_inputs([tmp_path], caption_suffixes=("_VILA1-5-13B",))
    proportion = {"prompt": 1, "VILA1-5-13B": 3}
    chosen = [choose_caption(s, proportion, seed=0) for s in listing.samples]
    with_vila = Counter(kind for (kind, _), s in zip(chosen, listing.samples) if "VILA1-5-13B" in s.captions)
    without = Counter(kind for (kind, _), s in zip(chosen, listing.samples) if "VILA1-5-13B" not in s.captions)
    assert without == {"prompt": 200}  # the drawn type is absent: Sana falls back to "prompt"
    assert 130 < with_vila["VILA1-5-13B"] < 170 and with_vila["prompt"] + with_vila["VILA1-5-13B"] == 200  # 3:1
    assert all(text.endswith(str(i)) for i, (_, text) in enumerate(chosen))
    # a function of (seed, sample): the same again, another seed differs
    assert chosen == [choose_caption(s, proportion, seed=0) for s in listing.samples]
    assert chosen != [choose_caption(s, proportion, seed=1) for s in listing.samples]


# ---------------------------------------------------------------------------------------------
# JSONL manifest


def test_manifest_lines_and_their_errors(tmp_path):
    (tmp_path / "imgs").mkdir()
    lines = [
        {"path": "imgs/a.png", "caption": "plain"},
        {
            "path": str(tmp_path / "imgs" / "b.png"),
            "captions": {"prompt": "p", "short": "s"},
            "width": 30,
            "height": 20,
        },
        {"path": "imgs/c.png", "captions": ["one", "two", "three"], "key": "custom"},
        {"path": "imgs/d.png"},
        {"path": "imgs/e.png", "caption": "x", "width": 10},
        ["not", "an", "object"],
    ]
    text = "\n".join(json.dumps(line) for line in lines) + "\n\n{not json\n"
    manifest = tmp_path / "data.jsonl"
    manifest.write_text(text)
    listing = list_inputs([manifest])
    samples = {s.key: s for s in listing.samples}
    assert list(samples) == ["imgs/a.png", str(tmp_path / "imgs" / "b.png"), "custom"]
    assert samples["imgs/a.png"].image.path == str(tmp_path / "imgs" / "a.png")
    assert samples[str(tmp_path / "imgs" / "b.png")].size == (30, 20)
    assert samples["custom"].uniform_captions
    kinds = Counter(choose_caption(samples["custom"], {"prompt": 1}, seed)[1] for seed in range(300))
    assert set(kinds) == {"one", "two", "three"} and min(kinds.values()) > 70  # uniform over the list
    errors = {skip.source.rsplit(":", 1)[-1]: skip.reason for skip in listing.skipped}
    assert errors["4"].startswith('bad manifest line (expected "caption"')
    assert errors["5"] == 'bad manifest line ("width" and "height" must both be positive integers)'
    assert errors["6"].startswith('bad manifest line (expected an object with a "path"')
    assert errors["8"].startswith("bad manifest line (Expecting property name")


# ---------------------------------------------------------------------------------------------
# Webdataset tar shards


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def write_shard(path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as archive:
        for key, members in samples.items():
            for extension, data in members.items():
                add_member(archive, f"{key}.{extension}", data)


def test_tar_samples_group_members_by_key_with_sana_side_captions(tmp_path):
    info = {"prompt": "from json", "width": 40, "height": 30, "InternVL2-26B": "vlm caption", "clip": 0.5}
    write_shard(
        tmp_path / "00000.tar",
        {
            "s0": {"jpg": image_bytes(40, 30, fmt="JPEG"), "json": json.dumps(info).encode()},
            "dir/s1": {"png": image_bytes(8, 8), "txt": b" text caption \n", "x.json": b"{}"},
            "s2": {"json": json.dumps({"prompt": "no image"}).encode()},
        },
    )
    write_shard(tmp_path / "00001.tar", {"s0": {"webp": image_bytes(8, 8, fmt="WEBP"), "txt": b"other shard"}})
    # beside the shard: an entry with a "prompt" is stored under the suffix name; others merge as they are
    (tmp_path / "00000_VILA1-5-13B.json").write_text(json.dumps({"s0": {"prompt": "vila says"}}))
    (tmp_path / "00000_extra.json").write_text(json.dumps({"dir/s1": {"short": "short one"}}))
    (tmp_path / "wids-meta.json").write_text(json.dumps({"shardlist": [{"url": "00001.tar"}, {"url": "00000.tar"}]}))
    listing = list_inputs([tmp_path], caption_suffixes=("", "_VILA1-5-13B", "_extra"))
    samples = {s.key: s for s in listing.samples}
    assert list(samples) == ["00001.tar/s0", "00000.tar/s0", "00000.tar/dir/s1"]  # wids-meta.json's order
    s0 = samples["00000.tar/s0"]
    assert s0.size == (40, 30)
    assert s0.captions == {"prompt": "from json", "InternVL2-26B": "vlm caption", "_VILA1-5-13B": "vila says"}
    assert Image.open(io.BytesIO(s0.image.read())).size == (40, 30)  # read in place from the tar
    assert s0.image.describe() == f"{tmp_path / '00000.tar'}:s0.jpg"
    assert samples["00000.tar/dir/s1"].captions == {"prompt": "text caption", "short": "short one"}
    assert samples["00001.tar/s0"].captions == {"prompt": "other shard"}
    assert reasons(listing)["00000.tar:s2"] == "no image member (found: json)"


def test_truncated_tar_keeps_the_samples_before_the_break(tmp_path):
    write_shard(tmp_path / "full.tar", {f"k{i}": {"png": image_bytes(64, 64, i), "txt": b"c"} for i in range(4)})
    data = (tmp_path / "full.tar").read_bytes()
    with tarfile.open(tmp_path / "full.tar") as archive:
        cut = archive.getmember("k2.png").offset_data + 100  # in the middle of k2's image
    (tmp_path / "full.tar").unlink()
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    listing = list_inputs([tmp_path / "cut.tar"])
    assert [s.key for s in listing.samples] == ["cut.tar/k0", "cut.tar/k1"]
    assert reasons(listing) == {"cut.tar": "truncated tar shard: k2.png ends beyond the end of the file"}


def test_several_inputs_keep_keys_apart_and_unknown_paths_are_named(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    for folder in ("one", "two"):
        (tmp_path / folder / "a.png").write_bytes(b"")
        (tmp_path / folder / "a.txt").write_text(folder)
    listing = list_inputs([tmp_path / "one", tmp_path / "two"])
    assert [s.key for s in listing.samples] == ["0:a", "1:a"]
    with pytest.raises(FileNotFoundError, match="input .*missing.csv: expected an image folder"):
        list_inputs([tmp_path / "missing.csv"])


# ---------------------------------------------------------------------------------------------
# Images


def test_corrupt_and_truncated_images_raise_bad_image():
    with pytest.raises(BadImage, match="not an image file"):
        image_size(b"certainly not a png")
    png = image_bytes(64, 64)
    assert image_size(png[:100]) == (64, 64)  # the header is intact...
    with pytest.raises(BadImage, match="truncated"):
        decode_rgb(png[: len(png) // 2])  # ...but the pixels are not
    rgba = io.BytesIO()
    Image.new("RGBA", (5, 4), (10, 20, 30, 0)).save(rgba, format="PNG")
    assert decode_rgb(rgba.getvalue()).mode == "RGB"


@pytest.mark.parametrize(
    "image_wh, bucket_hw, resized_wh, offset",
    [
        ((300, 200), (128, 128), (192, 128), (32, 0)),  # wider than the bucket: height fits, centre columns kept
        ((200, 300), (128, 128), (128, 192), (0, 32)),
        ((101, 300), (88, 176), (176, 522), (0, 217)),  # tall image into a wide bucket: width fits
        ((175, 87), (88, 176), (177, 88), (0, 0)),  # int() floors to 176.9 -> 177 columns, left offset rounds to 0
    ],
)
def test_resize_and_crop_covers_the_bucket_and_keeps_the_centre(image_wh, bucket_hw, resized_wh, offset):
    image = decode_rgb(image_bytes(*image_wh))
    pixels = resize_and_crop(image, *bucket_hw)
    assert pixels.shape == (3, *bucket_hw) and pixels.dtype == torch.float32
    expected = image.resize(resized_wh, Image.Resampling.BICUBIC)
    left, top = offset
    expected = expected.crop((left, top, left + bucket_hw[1], top + bucket_hw[0]))
    expected = torch.tensor(list(expected.tobytes()), dtype=torch.float32).view(*bucket_hw, 3).permute(2, 0, 1)
    assert torch.equal(pixels, expected / 127.5 - 1.0)
    assert pixels.min() >= -1 and pixels.max() <= 1
