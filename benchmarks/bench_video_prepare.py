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
writes it); each configuration runs under torchrun, one thread per rank. Clips/s counts the whole `prepare`
call after the encoders are loaded (listing and probing the clips, the null caption, decoding, encoding,
writing); peak memory is each rank's peak RSS (CPU) or max allocated memory (CUDA), loading included.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_prepare import CAPTION, GEMMA2_2B, GIB, write_gemma2_2b  # noqa: E402

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
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sana2.components.stats import memory_stats
    from sana2.config import Encoding
    from sana2.distributed.frozen_encoder import parameter_bytes
    from sana2.encoders.autoencoder import build_autoencoder
    from sana2.encoders.text_encoder import SANA_INSTRUCTION, build_text_encoder
    from sana2.prepare import PrepareOptions, prepare

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    work = Path(args.workdir)
    start = time.perf_counter()
    vae = build_autoencoder(work / "wan2.1", device=device, keep_decoder=False)  # float32, as Sana runs it
    mesh = init_device_mesh(device.type, (world,)) if world > 1 else None
    text = build_text_encoder(
        str(work / "gemma-2-2b"), 300, device=device, dtype=torch.bfloat16, instruction=SANA_INSTRUCTION, mesh=mesh
    )
    dist.barrier()
    load_seconds = time.perf_counter() - start
    options = PrepareOptions(
        inputs=[str(work / "clips")],
        output=args.out_dir,
        encoding=Encoding(
            buckets=f"{HEIGHT}x{WIDTH}",
            vae=str(work / "wan2.1"),
            text_encoder=str(work / "gemma-2-2b"),
            dtype="bfloat16",  # the text encoder above (the Wan VAE runs in float32 whatever it says)
            shard_text_encoder=world > 1,
            workers=0,
            num_frames=FRAMES[args.tiny],
            fps=FPS,
        ),
        batch_size=1,
        shard_size=1,
        overwrite=True,
    )
    start = time.perf_counter()
    summary = prepare(options, vae=vae, text_encoder=text)
    prepare_seconds = time.perf_counter() - start
    memory = memory_stats(device)
    peak = memory.get("memory/peak_rss_gib", memory.get("memory/max_allocated_gib"))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, (peak, parameter_bytes(text.model) / GIB))
    if rank == 0:
        result = {
            "world_size": world,
            "clips": summary.encoded,
            "load_seconds": load_seconds,
            "prepare_seconds": prepare_seconds,
            "clips_per_second": summary.encoded / prepare_seconds,
            "peak_gib_per_rank": [p for p, _ in per_rank],
            "text_encoder_param_gib_per_rank": [t for _, t in per_rank],
        }
        Path(args.result).write_text(json.dumps(result))
    del text, vae
    gc.collect()
    dist.destroy_process_group()


def run(workdir: Path, world_size: int, tiny: bool) -> dict:
    result = workdir / f"result_{world_size}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", __file__]
    cmd += ["--worker", "--workdir", str(workdir), "--result", str(result), "--out-dir", str(workdir / "out")]
    cmd += ["--tiny"] if tiny else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


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
        f"over 2 ranks) with Sana's instruction, batch 1, {results[0]['clips']} clips, 1 thread per rank"
    )
    header = f"{'ranks':>5} {'load s':>7} {'prepare s':>9} {'clips/s':>8} {'text enc. GiB/rank':>19}"
    print(f"{header} {'peak GiB/rank':>14}")
    for r in results:
        params = " ".join(f"{p:.2f}" for p in r["text_encoder_param_gib_per_rank"])
        peaks = " ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(
            f"{r['world_size']:>5} {r['load_seconds']:>7.1f} {r['prepare_seconds']:>9.1f} "
            f"{r['clips_per_second']:>8.4f} {params:>19} {peaks:>14}"
        )


if __name__ == "__main__":
    main()
