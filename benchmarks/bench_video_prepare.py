"""Precomputation of clips (`sana2-prepare --num-frames`) with Sana-Video's real encoder architectures, built from
their configs with random weights: the Wan 2.1 VAE (diffusers' AutoencoderKLWan defaults, float32 as Sana runs
it) on 33-frame 240x416 clips at 16 fps, and Gemma-2-2B in bf16 with Sana's instruction (300 caption tokens).
Clips per second at 1 and 2 ranks (the text encoder whole on one rank, sharded over two), and peak memory per
rank.

    flock /tmp/sana2-heavy.lock python benchmarks/bench_video_prepare.py [--clips 2] [--ranks 1,2] [--tiny]

`--tiny` swaps in a small Wan-layout VAE (base_dim 16, same 4x time / 8x space), a 4-layer Gemma-2 (hidden 256)
and 9-frame clips, so the whole pipeline (decode, resample, crop, encode, shard the text encoder, write) can be
timed in minutes on a busy CPU; its figures are not the issue's figures.

The encoders and clips are written once to a work folder (the Gemma-2-2B folder as benchmarks/bench_prepare.py
writes it); each configuration runs under torchrun, one thread per rank (benchmarks/prepare_timing.py: clips/s
counts the whole `prepare` call after the encoders are loaded, listing and probing the clips included; peak
memory is per rank, loading included).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_prepare import CAPTION, GEMMA2_2B, write_gemma2_2b  # noqa: E402
from prepare_timing import launch, timed_prepare  # noqa: E402

FPS, HEIGHT, WIDTH = 16, 240, 416
FRAMES = {False: 33, True: 9}  # by --tiny
TINY_GEMMA2 = {**GEMMA2_2B, **dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64)}
TINY_GEMMA2["query_pre_attn_scalar"] = 64
TINY_WAN = dict(base_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)  # Wan 2.1's 16 channels, 4x time, 8x space


def write_wan21(folder: Path, tiny: bool) -> None:
    from diffusers import AutoencoderKLWan

    # its defaults are Wan 2.1's: 16 channels, 4x time, 8x space
    AutoencoderKLWan(**(TINY_WAN if tiny else {})).save_pretrained(folder)


def write_clips(folder: Path, count: int) -> None:
    """`count` clips of 52 frames at 24 fps, 256x448 (resampled to 35 at 16 fps, of which 33 cropped to 240x416)."""
    from fractions import Fraction

    import av
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        with av.open(str(folder / f"{index:04d}.mp4"), "w") as container:
            stream = container.add_stream("libx264", rate=Fraction(24))
            stream.width, stream.height, stream.pix_fmt = 448, 256, "yuv420p"
            base = rng.integers(0, 256, (256, 448, 3), dtype=np.uint8)
            for t in range(52):  # a moving texture: 52 frames at 24 fps give 35 at 16 fps
                frame = np.roll(base, 4 * t, axis=1)
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        (folder / f"{index:04d}.txt").write_text(CAPTION)


def worker(args) -> None:
    from sana2.config import Encoding
    from sana2.prepare import PrepareOptions

    work = Path(args.workdir)
    options = PrepareOptions(
        inputs=[str(work / "clips")],
        output=args.out_dir,
        encoding=Encoding(
            buckets=f"{HEIGHT}x{WIDTH}",
            vae=str(work / "wan2.1"),
            text_encoder=str(work / "gemma-2-2b"),
            dtype="bfloat16",  # the text encoder (the Wan VAE runs in float32 whatever it says, as Sana runs it)
            shard_text_encoder=True,  # over 2 ranks; whole on 1
            workers=0,
            num_frames=FRAMES[args.tiny],
            fps=FPS,
        ),
        batch_size=1,
        shard_size=1,
        overwrite=True,
    )
    timed_prepare(options, Path(args.result))


def run(workdir: Path, world_size: int, tiny: bool) -> dict:
    worker_args = ["--workdir", str(workdir), "--out-dir", str(workdir / "out")] + (["--tiny"] if tiny else [])
    return launch(__file__, world_size, worker_args, workdir / f"result_{world_size}.json")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clips", type=int, default=2, help="clips to encode per configuration")
    parser.add_argument("--ranks", default="1,2", help="the world sizes to run (default 1,2)")
    parser.add_argument("--workdir", help="keep the encoders and clips here (default: a temporary folder)")
    parser.add_argument("--tiny", action="store_true", help="tiny encoders and 9-frame clips (minutes on a CPU)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--result")
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        start = time.perf_counter()
        if not (work / "gemma-2-2b").exists():
            write_gemma2_2b(work / "gemma-2-2b", TINY_GEMMA2 if args.tiny else GEMMA2_2B)
        if not (work / "wan2.1").exists():
            write_wan21(work / "wan2.1", args.tiny)
        if not (work / "clips").exists():
            write_clips(work / "clips", args.clips)
        print(f"encoders and {args.clips} clips written in {time.perf_counter() - start:.0f}s", flush=True)
        results = []
        for world_size in (int(n) for n in args.ranks.split(",")):
            results.append(run(work, world_size, args.tiny))
            print(json.dumps(results[-1]), flush=True)
    size = "tiny Wan-layout VAE" if args.tiny else "Wan 2.1 VAE"
    text = "tiny Gemma-2" if args.tiny else "Gemma-2-2B"
    print(
        f"\n{size} (float32) on {FRAMES[args.tiny]}-frame {HEIGHT}x{WIDTH} clips at {FPS} fps, {text} (bf16, sharded "
        f"over 2 ranks) with Sana's instruction, batch 1, {results[0]['encoded']} clips, 1 thread per rank"
    )
    header = f"{'ranks':>5} {'load s':>7} {'prepare s':>9} {'clips/s':>8} {'text enc. GiB/rank':>19}"
    print(f"{header} {'peak GiB/rank':>14}")
    for r in results:
        params = " ".join(f"{p:.2f}" for p in r["text_encoder_param_gib_per_rank"])
        peaks = " ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(
            f"{r['world_size']:>5} {r['load_seconds']:>7.1f} {r['prepare_seconds']:>9.1f} "
            f"{r['per_second']:>8.4f} {params:>19} {peaks:>14}"
        )


if __name__ == "__main__":
    main()
