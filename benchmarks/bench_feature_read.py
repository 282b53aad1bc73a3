"""What the feature shards' CRC32 check costs a training run: opening a dataset, and reading from a shard the
first time (its tensors checked) and afterwards (not again).

    python benchmarks/bench_feature_read.py [--shards 4] [--samples 256] [--latent 32,32,32] [--caption 300,2304]

Writes a version-1 dataset of `--shards` shards of `--samples` samples each (bf16 latents [C, H, W], bf16
caption embeddings [L, C_cap]: by default DC-AE f32c32 at 1024px and Gemma-2-2B's 300 tokens, 1.45 MB a
sample) to a temporary folder, then times, in one process: `FeatureDataset(...)` (headers only), the first
batch of each shard (the check reads the whole shard once), and a second batch of each shard. The files
are in the page cache (just written), so the figures are the CPU cost of the check; from a cold disk the
first read also waits for the shard's bytes.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from sana2.data.features import FeatureDataset
from sana2.data.writer import write_feature_dataset

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256, help="samples per shard")
    parser.add_argument("--latent", default="32,32,32", help="C,H,W of one latent")
    parser.add_argument("--caption", default="300,2304", help="L,C_cap of one caption")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    latent = tuple(int(d) for d in args.latent.split(","))
    length, width = (int(d) for d in args.caption.split(","))
    total = args.shards * args.samples
    with tempfile.TemporaryDirectory() as work:
        folder = Path(work) / "features"
        latents = torch.randn(total, *latent, dtype=torch.bfloat16)
        embeds = torch.randn(total, length, width, dtype=torch.bfloat16)
        mask = torch.ones(total, length, dtype=torch.int64)
        write_feature_dataset(folder, latents, embeds, mask, shard_size=args.samples)
        shard_bytes = sum(p.stat().st_size for p in folder.glob("shard_*.safetensors")) / args.shards
        del latents, embeds, mask

        start = time.perf_counter()
        dataset = FeatureDataset(folder)
        opened = time.perf_counter() - start
        first, later = [], []
        for shard in range(args.shards):
            indices = list(range(shard * args.samples, shard * args.samples + args.batch))
            for times in (first, later):
                start = time.perf_counter()
                dataset.get_batch(indices)
                times.append(time.perf_counter() - start)
    first_mean, later_mean = sum(first) / len(first), sum(later) / len(later)
    print(f"$ python {' '.join(sys.argv)}")
    print(f"{args.shards} shards of {args.samples} samples, {shard_bytes / MB:.0f} MB each; batch {args.batch}")
    print(f"open the dataset (headers):          {opened * 1e3:8.1f} ms")
    print(f"first batch of a shard (CRC32 check): {first_mean * 1e3:8.1f} ms")
    print(f"later batch of a shard:               {later_mean * 1e3:8.1f} ms")
    check = first_mean - later_mean
    print(f"check: {check:.2f} s per shard, {shard_bytes / check / MB:.0f} MB/s (once per shard per process)")


if __name__ == "__main__":
    main()
