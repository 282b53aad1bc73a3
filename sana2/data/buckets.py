"""Aspect-ratio buckets: Sana's tables of (height / width ratio -> [height, width]) and the rule that puts
an image into one.

Sana trains multi-scale models on images of many shapes by giving each image the bucket whose ratio
key is nearest to the image's height / width, resizing it so that it covers the bucket and cropping
the centre. Every bucket of a table holds about the same number of pixels (the table's base size
squared), with both sides multiples of 32 so that DC-AE f32 latents have whole sizes.

The tables are Sana's data (its `ASPECT_RATIO_<base>` dictionaries): the 512 table is listed here
row by row; the 128, 256, 1024, 2048 and 4096 tables are exactly that table scaled by base / 512,
which is how Sana's values relate. The 2880 table is not a scaled copy and is listed on its own.
The video tables (ASPECT_RATIO_VIDEO_480, ASPECT_RATIO_VIDEO_720) are Sana-Video's eleven 480p and 720p
buckets, as diffusers' SanaVideoPipeline lists them. The ratio keys are Sana's own rounded strings, and
the nearest bucket is chosen by the key's value
(not by the bucket's exact height / width), as Sana does, the first key winning a tie.
"""

from dataclasses import dataclass

# (ratio key, height, width) of Sana's ASPECT_RATIO_512
_BASE_512 = (
    ("0.25", 256, 1024), ("0.26", 256, 992), ("0.27", 256, 960), ("0.28", 256, 928),
    ("0.32", 288, 896), ("0.33", 288, 864), ("0.35", 288, 832), ("0.4", 320, 800),
    ("0.42", 320, 768), ("0.48", 352, 736), ("0.5", 352, 704), ("0.52", 352, 672),
    ("0.57", 384, 672), ("0.6", 384, 640), ("0.68", 416, 608), ("0.72", 416, 576),
    ("0.78", 448, 576), ("0.82", 448, 544), ("0.88", 480, 544), ("0.94", 480, 512),
    ("1.0", 512, 512), ("1.07", 512, 480), ("1.13", 544, 480), ("1.21", 544, 448),
    ("1.29", 576, 448), ("1.38", 576, 416), ("1.46", 608, 416), ("1.67", 640, 384),
    ("1.75", 672, 384), ("2.0", 704, 352), ("2.09", 736, 352), ("2.4", 768, 320),
    ("2.5", 800, 320), ("2.89", 832, 288), ("3.0", 864, 288), ("3.11", 896, 288),
    ("3.62", 928, 256), ("3.75", 960, 256), ("3.88", 992, 256), ("4.0", 1024, 256),
)  # fmt: skip

# Sana's ASPECT_RATIO_2880 (not a multiple of the 512 table)
_TABLE_2880 = (
    ("0.25", 1408, 5760), ("0.26", 1408, 5568), ("0.27", 1408, 5376), ("0.28", 1408, 5184),
    ("0.32", 1600, 4992), ("0.33", 1600, 4800), ("0.34", 1600, 4672), ("0.4", 1792, 4480),
    ("0.42", 1792, 4288), ("0.47", 1920, 4096), ("0.49", 1920, 3904), ("0.51", 1920, 3776),
    ("0.55", 2112, 3840), ("0.59", 2112, 3584), ("0.68", 2304, 3392), ("0.72", 2304, 3200),
    ("0.78", 2496, 3200), ("0.83", 2496, 3008), ("0.89", 2688, 3008), ("0.93", 2688, 2880),
    ("1.0", 2880, 2880), ("1.07", 2880, 2688), ("1.12", 3008, 2688), ("1.21", 3008, 2496),
    ("1.28", 3200, 2496), ("1.39", 3200, 2304), ("1.47", 3392, 2304), ("1.7", 3584, 2112),
    ("1.82", 3840, 2112), ("2.03", 3904, 1920), ("2.13", 4096, 1920), ("2.39", 4288, 1792),
    ("2.5", 4480, 1792), ("2.92", 4672, 1600), ("3.0", 4800, 1600), ("3.12", 4992, 1600),
    ("3.68", 5184, 1408), ("3.82", 5376, 1408), ("3.95", 5568, 1408), ("4.0", 5760, 1408),
)  # fmt: skip


# Sana-Video's buckets, as diffusers' SanaVideoPipeline lists them (ASPECT_RATIO_480_BIN, ASPECT_RATIO_720_BIN):
# 480p / 720p clips of eleven shapes, both sides multiples of 16 (Wan VAE 8x, patch size 2)
_VIDEO_480 = (
    ("0.5", 448, 896), ("0.57", 480, 832), ("0.68", 528, 768), ("0.78", 560, 720), ("1.0", 624, 624),
    ("1.13", 672, 592), ("1.29", 720, 560), ("1.46", 768, 528), ("1.67", 816, 496), ("1.75", 832, 480),
    ("2.0", 896, 448),
)  # fmt: skip
_VIDEO_720 = (
    ("0.5", 672, 1344), ("0.57", 704, 1280), ("0.68", 800, 1152), ("0.78", 832, 1088), ("1.0", 960, 960),
    ("1.13", 1024, 896), ("1.29", 1088, 832), ("1.46", 1152, 800), ("1.67", 1248, 736), ("1.75", 1280, 704),
    ("2.0", 1344, 672),
)  # fmt: skip


def _scaled(base: int) -> dict[str, tuple[int, int]]:
    return {key: (h * base // 512, w * base // 512) for key, h, w in _BASE_512}


ASPECT_RATIO_TABLES: dict[str, dict[str, tuple[int, int]]] = {
    "ASPECT_RATIO_128": _scaled(128),
    "ASPECT_RATIO_256": _scaled(256),
    "ASPECT_RATIO_512": _scaled(512),
    "ASPECT_RATIO_1024": _scaled(1024),
    "ASPECT_RATIO_2048": _scaled(2048),
    "ASPECT_RATIO_2880": {key: (h, w) for key, h, w in _TABLE_2880},
    "ASPECT_RATIO_4096": _scaled(4096),
    "ASPECT_RATIO_VIDEO_480": {key: (h, w) for key, h, w in _VIDEO_480},
    "ASPECT_RATIO_VIDEO_720": {key: (h, w) for key, h, w in _VIDEO_720},
}
# Sana resizes into its two largest tables with Lanczos, into the others with bicubic interpolation
LANCZOS_TABLES = {"ASPECT_RATIO_2048", "ASPECT_RATIO_2880", "ASPECT_RATIO_4096"}


@dataclass(frozen=True)
class Bucket:
    """One entry of a table: its ratio key (height / width, as Sana writes it) and its image size."""

    name: str
    height: int
    width: int


def bucket_table(name: str) -> list[Bucket]:
    """The buckets of table `name` (e.g. "ASPECT_RATIO_1024"), in ascending ratio order."""
    if name not in ASPECT_RATIO_TABLES:
        raise ValueError(f"unknown aspect-ratio table {name!r}; expected one of {sorted(ASPECT_RATIO_TABLES)}")
    return [Bucket(key, h, w) for key, (h, w) in ASPECT_RATIO_TABLES[name].items()]


def single_bucket(height: int, width: int) -> list[Bucket]:
    """A one-bucket table: every image is resized and centre-cropped to height x width."""
    if height < 1 or width < 1:
        raise ValueError(f"bucket size must be positive, got {height}x{width}")
    return [Bucket(f"{height / width:.2f}", height, width)]


def parse_buckets(spec: str) -> list[Bucket]:
    """The buckets `spec` names: a table ("ASPECT_RATIO_1024") or one size "HxW" (e.g. "512x768")."""
    if "x" in spec and spec.replace("x", "", 1).isdigit():
        height, width = (int(v) for v in spec.split("x"))
        return single_bucket(height, width)
    return bucket_table(spec)


def resample_filter(spec: str) -> str:
    """Sana's interpolation for images resized into the buckets `spec` names."""
    return "lanczos" if spec in LANCZOS_TABLES else "bicubic"


def nearest_bucket(height: int, width: int, buckets: list[Bucket]) -> int:
    """Index of the bucket whose ratio key is nearest to height / width (the first one on a tie)."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = height / width
    return min(range(len(buckets)), key=lambda i: abs(float(buckets[i].name) - ratio))
