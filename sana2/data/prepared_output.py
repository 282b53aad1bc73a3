"""The folder `sana2-prepare` writes: what an interrupted run left to do, completing it, and its summary.

While a run is in progress the folder holds `prepare_plan.json` (the fingerprint of the plan: inputs and
settings), the null caption and the shards written so far, each complete (written under a temporary name
and renamed). A run started again with the same inputs and settings writes only the missing shards; with
other inputs or settings it stops, naming the folder, unless told to overwrite. When every shard is in, the
shards are checked against the plan, the skip report is written, and meta.json last: from then on the
folder is a version-2 feature dataset.
"""

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sana2.data.dataset_plan import DatasetPlan
from sana2.data.features import (
    BUCKETED_VERSION,
    FORMAT_NAME,
    META_FILE,
    NULL_CAPTION_FILE,
    SKIP_REPORT_FILE,
    DataFormatError,
    bucket_entry,
    read_shard_info,
    shard_file_name,
)
from sana2.data.sources import Listing
from sana2.data.writer import skip_counts, write_meta, write_skip_report
from sana2.staging import OUTPUT_MARKER, OutputRefused, claim_output, mark_output, output_kind, remove, staged

PLAN_FILE = "prepare_plan.json"
OUTPUT_KIND = "sana2-prepare"


def is_own_output(folder: Path) -> bool:
    """A folder this command wrote: marked, or (written before the marker existed) holding its plan file."""
    return output_kind(folder) == OUTPUT_KIND or (folder / PLAN_FILE).is_file()


def claim_prepared_output(output: Path, options, listing: Listing) -> None:
    """Check --output before anything is written, and with --overwrite remove an earlier output there.

    Refused: an output that is, contains or lies inside an input (the input paths, the folders of the
    images they list, the encoders' folders), or an existing folder this command did not write.
    """
    inputs = {Path(path) for path in options.inputs}
    inputs |= {Path(sample.image.path).parent for sample in listing.samples}
    encoding = options.encoding
    inputs |= {Path(path) for path in (encoding.vae, encoding.text_encoder) if Path(path).exists()}
    if claim_output(output, OUTPUT_KIND, sorted(inputs), is_own=is_own_output) and options.overwrite:
        foreign = [entry.name for entry in sorted(output.iterdir()) if not _written_by_prepare(entry.name)]
        if foreign:
            raise OutputRefused(
                f"refusing to replace {output}: it holds what sana2-prepare did not write ({', '.join(foreign)}); "
                "move those out first, or choose another --output"
            )
        remove(output)


def _written_by_prepare(name: str) -> bool:
    """A name this command writes into its output (a temporary of a killed run included): the shards grow one
    by one, so the folder's marker cannot list them as a finished export's does."""
    if name.startswith("."):
        name = name[1:].rsplit(".", 1)[0]  # staging's temporary sibling: .<name>.<tag>-<pid>
    own = {META_FILE, NULL_CAPTION_FILE, SKIP_REPORT_FILE, PLAN_FILE, OUTPUT_MARKER}
    return name in own or re.fullmatch(r"shard_\d{5}\.safetensors", name) is not None


def pending_shards(output: Path, plan: DatasetPlan) -> list[int] | None:
    """Indices of the planned shards still to write, or None when the dataset is complete.

    Raises ValueError when `output` holds something else: another run's dataset, or unrelated files.
    """
    plan_file = output / PLAN_FILE
    if plan_file.is_file() and not _holds_work(output):
        remove(plan_file)  # a run that failed before any shard with samples: nothing to resume, nothing lost
    if plan_file.is_file():
        if json.loads(plan_file.read_text()).get("fingerprint") != plan.fingerprint:
            raise ValueError(
                f"{output} holds a dataset prepared from other inputs or settings ({plan_file} differs); "
                "pass --overwrite to replace it, or choose another --output"
            )
        if (output / META_FILE).is_file():
            return None
    else:  # absent or empty (claim_prepared_output checked): the folder becomes this command's
        output.mkdir(parents=True, exist_ok=True)
        mark_output(output, OUTPUT_KIND)
        with staged(plan_file, replace=True) as temporary:
            temporary.write_text(json.dumps({"fingerprint": plan.fingerprint, "shards": len(plan.shards)}, indent=1))
    pending = []
    for shard in plan.shards:
        try:
            read_shard_info(output / shard_file_name(shard.index))
        except DataFormatError:
            pending.append(shard.index)
    return pending


def _holds_work(output: Path) -> bool:
    """Whether an earlier run left a dataset or encoded shards there (worth resuming, or refusing over)."""
    return (output / META_FILE).is_file() or any(output.glob("shard_*.safetensors"))


def finalize(output: Path, plan: DatasetPlan, latent_shapes: list[tuple[int, ...]], metadata: dict) -> None:
    """Check every shard against the plan, write the skip report, then meta.json (last).

    Shards whose images all failed are removed; buckets that received no sample are left out of meta.json.
    """
    shards, skipped = [], [{"source": s.source, "reason": s.reason} for s in plan.skipped]
    per_bucket = Counter()
    caption_shape = None
    for planned in plan.shards:
        path = output / shard_file_name(planned.index)
        info = read_shard_info(path)
        shard_skips = json.loads(info.metadata.get("sana2_skipped", "[]"))
        expected = {p.sample.key for p in planned.samples}
        if len(info.keys) + len(shard_skips) != len(expected) or not set(info.keys) <= expected:
            raise RuntimeError(f"{path} does not hold the samples planned for it; run again with --overwrite")
        skipped += [{"source": source, "reason": reason} for source, reason in shard_skips]
        if info.num_samples == 0:
            remove(path)
            continue
        caption_shape = info.shapes["caption_embeds"][1:]
        shards.append({"file": path.name, "bucket": planned.bucket, "num_samples": info.num_samples})
        per_bucket[planned.bucket] += info.num_samples
    write_skip_report(output, skipped)  # also when nothing could be encoded: the error points to it
    if not shards:
        raise ValueError(
            f"no sample could be encoded: all {len(skipped)} inputs were skipped, listed with their reasons in "
            f"{output / SKIP_REPORT_FILE}; a corrected run may use the same --output"
        )
    used = sorted(per_bucket)
    renumber = {bucket: index for index, bucket in enumerate(used)}
    for shard in shards:
        shard["bucket"] = renumber[shard["bucket"]]
    buckets = [plan.buckets[b] for b in used]
    meta = {
        "format": FORMAT_NAME,
        "version": BUCKETED_VERSION,
        "num_samples": sum(s["num_samples"] for s in shards),
        "caption_length": caption_shape[0],
        "caption_dim": caption_shape[1],
        "buckets": [
            bucket_entry(bucket.name, (bucket.height, bucket.width), latent_shapes[b], per_bucket[b])
            for b, bucket in zip(used, buckets)
        ],
        "shards": shards,
        "null_caption": NULL_CAPTION_FILE,
        "metadata": {**metadata, "fingerprint": plan.fingerprint},
    }
    write_meta(output, meta)


@dataclass
class Summary:
    encoded: int  # samples in the dataset
    skipped: int
    skipped_by_reason: dict[str, int]
    per_bucket: dict[str, int]
    shards_written: int  # by this run, holding samples (a planned shard that ended up empty is not one)
    shards_reused: int
    seconds: float
    encoded_now: int = 0  # samples this run encoded: the rate's

    def lines(self, output: Path) -> list[str]:
        rate = self.encoded_now / self.seconds if self.seconds > 0 else 0.0
        listed = f", listed in {output / SKIP_REPORT_FILE}:" if self.skipped else ""
        lines = [
            f"encoded {self.encoded} samples into {output} ({self.shards_written} shards written, "
            f"{self.shards_reused} kept from an earlier run) in {self.seconds:.1f}s ({rate:.2f} images/s)",
            f"skipped {self.skipped} inputs{listed}",
        ]
        lines += [f"  {count:7d}  {reason}" for reason, count in sorted(self.skipped_by_reason.items())]
        lines.append("per bucket (height/width ratio: samples):")
        lines += [f"  {name:>6}: {count}" for name, count in self.per_bucket.items()]
        return lines


def summarize(output: Path, written: list[int], seconds: float) -> Summary:
    """The summary of a complete output folder; `written`: the indices of the shards this run wrote."""
    meta = json.loads((output / META_FILE).read_text())
    with open(output / SKIP_REPORT_FILE) as report:
        reasons = skip_counts([json.loads(line) for line in report])
    names = {shard_file_name(index) for index in written}
    now = [shard for shard in meta["shards"] if shard["file"] in names]
    return Summary(
        encoded=meta["num_samples"],
        skipped=sum(reasons.values()),
        skipped_by_reason=dict(reasons),
        per_bucket={b["name"]: b["num_samples"] for b in meta["buckets"]},
        shards_written=len(now),
        shards_reused=len(meta["shards"]) - len(now),
        seconds=seconds,
        encoded_now=sum(shard["num_samples"] for shard in now),
    )
