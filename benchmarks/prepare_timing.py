"""The timed `prepare` run that benchmarks/bench_prepare.py and bench_video_prepare.py share: each script runs
itself under torchrun (`launch`) and its worker times one `prepare` call (`timed_prepare`).

The encoders are built as `sana2-prepare` builds them, from the options' [encoding] section, with the text
encoder sharded over the data-parallel ranks of `ParallelDims` where the section says so. Load seconds count
building the encoders; prepare seconds the whole `prepare` call after that (listing, planning, the null
caption, decoding, encoding, writing); peak memory is each rank's peak RSS (CPU) or max allocated memory
(CUDA) over the whole run, loading included.
"""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def launch(script: str, world_size: int, worker_args: list[str], result: Path) -> dict:
    """Run `script --worker *worker_args --result result` on `world_size` ranks, one thread each, offline; the
    result rank 0 wrote."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}", script]
    cmd += ["--worker", *worker_args, "--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def timed_prepare(options, result: Path) -> None:
    """On every rank of a torchrun job: build the encoders of `options` (sana2.prepare.PrepareOptions), time
    `prepare` with them, and write the figures to `result` from rank 0."""
    import torch
    import torch.distributed as dist

    from sana2.components.stats import memory_stats
    from sana2.data.shard_encoding import build_encoding_text_encoder, build_encoding_vae
    from sana2.distributed.frozen_encoder import parameter_bytes
    from sana2.distributed.parallel_dims import ParallelDims
    from sana2.prepare import prepare

    dist.init_process_group("gloo")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    dims = ParallelDims(1, dist.get_world_size(), device_type=device.type)  # prepare is data-parallel
    start = time.perf_counter()
    vae = build_encoding_vae(options.encoding, device)
    text = build_encoding_text_encoder(options.encoding, options.max_length, device, dims)
    dist.barrier()
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    summary = prepare(options, vae=vae, text_encoder=text)
    prepare_seconds = time.perf_counter() - start
    memory = memory_stats(device)
    peak = memory.get("memory/peak_rss_gib", memory.get("memory/max_allocated_gib"))
    per_rank = [None] * dims.world_size
    dist.all_gather_object(per_rank, (peak, parameter_bytes(text.model) / GIB, parameter_bytes(vae.model) / GIB))
    if dims.rank == 0:
        figures = {
            "world_size": dims.world_size,
            "sharded": options.encoding.shard_text_encoder and dims.dp_size > 1,
            "encoded": summary.encoded,
            "instruction_tokens": text.instruction_tokens,
            "load_seconds": load_seconds,
            "prepare_seconds": prepare_seconds,
            "per_second": summary.encoded / prepare_seconds,
            "peak_gib_per_rank": [p for p, _, _ in per_rank],
            "text_encoder_param_gib_per_rank": [t for _, t, _ in per_rank],
            "vae_param_gib_per_rank": [v for _, _, v in per_rank],
        }
        result.write_text(json.dumps(figures))
    del text, vae
    gc.collect()  # free FSDP state before the process group, or the exit can abort
    dist.destroy_process_group()
