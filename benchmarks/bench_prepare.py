"""Precomputation (`sana2-prepare`) with Sana's real encoder architectures, built from their configs with random
weights: DC-AE f32c32 on 512x512 images and Gemma-2-2B in bf16 with Sana's instruction prefix (300 caption
tokens). Images per second at 1 and 2 ranks, and peak memory per rank with the text encoder whole on every
rank or sharded over the ranks (`--shard-text-encoder`).

    flock /tmp/sana2-heavy.lock python benchmarks/bench_prepare.py [--images 4]

The encoders are written once to a work folder as a user would have them (a diffusers folder for the VAE, a
safetensors Gemma-2 folder with a word-level tokenizer whose token counts are close to Gemma's for English
text), then every configuration runs under torchrun, one thread per rank (benchmarks/prepare_timing.py:
images/s counts the whole `prepare` call after the encoders are loaded; peak memory is per rank, loading
included).
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_timing import GIB, launch, timed_prepare  # noqa: E402

# google/gemma-2-2b(-it)'s architecture, as its config.json gives it
GEMMA2_2B = dict(
    vocab_size=256000,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=8192,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    architectures=["Gemma2ForCausalLM"],
)
CAPTION = (
    "A wide photograph of a quiet harbour at dawn, with small wooden fishing boats painted red, blue and yellow, "
    "moored along a stone quay. Soft golden light falls on the calm water, gulls circle above the masts, and a "
    "row of white houses with terracotta roofs climbs the green hill behind the town under a pale sky."
)


def write_gemma2_2b(folder: Path, architecture: dict = GEMMA2_2B) -> None:
    """A Gemma-2-2B folder (or `architecture`) with random bf16 weights, written one tensor at a time (keys
    "model.*" as released)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Gemma2Config, Gemma2Model

    from sana2.encoders.text_encoder import SANA_INSTRUCTION

    folder.mkdir(parents=True)
    config = Gemma2Config(**architecture)
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Gemma2Model(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    weight_map, part, part_bytes, files = {}, {}, 0, 0

    def flush():
        nonlocal part, part_bytes, files
        name = f"model-{files:05d}.safetensors"
        save_file(part, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        part, part_bytes, files = {}, 0, files + 1

    for name, shape in shapes.items():
        part[f"model.{name}"] = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        part_bytes += part[f"model.{name}"].nbytes
        if part_bytes > 2 * GIB:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    word_tokenizer(SANA_INSTRUCTION + " " + CAPTION).save_pretrained(folder)


def word_tokenizer(text: str):
    """Words and punctuation marks as tokens, BOS first (Gemma's convention)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    words = sorted({token for token, _ in pre_tokenizers.Whitespace().pre_tokenize_str(text)})
    vocab = {token: i for i, token in enumerate(specials + words)}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def write_dc_ae(folder: Path) -> None:
    from diffusers import AutoencoderDC

    from sana2.encoders.autoencoder import DC_AE_F32C32_CONFIG

    AutoencoderDC(**DC_AE_F32C32_CONFIG).save_pretrained(folder)


def write_images(folder: Path, count: int) -> None:
    """`count` 600x600 JPEGs with captions: all in the 512x512 bucket of ASPECT_RATIO_512."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        pixels = rng.integers(0, 256, (600, 600, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index:04d}.jpg", quality=90)
        (folder / f"{index:04d}.txt").write_text(CAPTION)


def worker(args) -> None:
    from sana2.config import Encoding
    from sana2.prepare import PrepareOptions

    work = Path(args.workdir)
    options = PrepareOptions(
        inputs=[str(work / "images")],
        output=args.out_dir,
        encoding=Encoding(
            buckets="ASPECT_RATIO_512",
            vae=str(work / "dc-ae"),
            text_encoder=str(work / "gemma-2-2b"),
            dtype="bfloat16",  # both encoders
            shard_text_encoder=args.sharded,
            workers=0,
        ),
        batch_size=args.batch_size,
        shard_size=args.batch_size,
        overwrite=True,  # encode everything, whatever an earlier run left in the work folder
    )
    timed_prepare(options, Path(args.result))


def run(workdir: Path, world_size: int, sharded: bool, batch_size: int) -> dict:
    result = workdir / f"result_{world_size}_{sharded}.json"
    worker_args = ["--workdir", str(workdir), "--out-dir", str(workdir / f"out_{world_size}_{sharded}")]
    worker_args += ["--batch-size", str(batch_size)] + (["--sharded"] if sharded else [])
    return launch(__file__, world_size, worker_args, result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=4, help="images to encode per configuration")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--workdir", help="keep the encoders and images here (default: a temporary folder)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--sharded", action="store_true")
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
            write_gemma2_2b(work / "gemma-2-2b")
        if not (work / "dc-ae").exists():
            write_dc_ae(work / "dc-ae")
        if not (work / "images").exists():
            write_images(work / "images", args.images)
        print(f"encoders and {args.images} images written in {time.perf_counter() - start:.0f}s")
        results = [run(work, 1, False, args.batch_size), run(work, 2, False, args.batch_size)]
        results.append(run(work, 2, True, args.batch_size))
    first = results[0]
    print(
        f"\nDC-AE f32c32 (bf16) on 512x512 images, Gemma-2-2B (bf16) with Sana's instruction "
        f"({first['instruction_tokens']} instruction tokens + 300 - 2 per caption), batch {args.batch_size}, "
        f"{first['encoded']} images, 1 thread per rank"
    )
    print(
        f"{'ranks':>5} {'text encoder':>12} {'load s':>7} {'prepare s':>9} {'images/s':>8} "
        f"{'text enc. params GiB/rank':>25} {'peak GiB per rank':>18}"
    )
    for r in results:
        params = " ".join(f"{p:.2f}" for p in r["text_encoder_param_gib_per_rank"])
        peaks = " ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
        print(
            f"{r['world_size']:>5} {'sharded' if r['sharded'] else 'whole':>12} {r['load_seconds']:>7.1f} "
            f"{r['prepare_seconds']:>9.1f} {r['per_second']:>8.3f} {params:>25} {peaks:>18}"
        )


if __name__ == "__main__":
    main()
