"""Tiny encoders saved as local model folders, built from configs with seeded random weights (no downloads):
a Gemma-2 decoder with a Gemma-like tokenizer (BOS first, no EOS, right padding), a T5 encoder-decoder, and
DC-AE / KL autoencoders; and small test images."""

import io
import string
from pathlib import Path

import torch
from PIL import Image

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def char_tokenizer(add_bos: bool, eos: bool = False):
    """A character-level fast tokenizer over printable ASCII: Gemma's conventions (BOS prefix) or T5's (EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(GEMMA_SPECIALS + list(string.printable))}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    template = ("<bos> " if add_bos else "") + "$A" + (" <eos>" if eos else "")
    model.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def save_tiny_gemma2(folder: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """A 2-layer Gemma-2 saved as its causal-LM checkpoint (keys "model.*", as released Gemma-2 folders hold)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tokenizer = char_tokenizer(add_bos=True)
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=4096,
        sliding_window=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    Gemma2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_tiny_t5(folder: Path, seed: int = 0) -> Path:
    """A T5 encoder-decoder checkpoint (the encoder is what sana2 loads from it)."""
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = char_tokenizer(add_bos=False, eos=True)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


TINY_DC_AE = dict(
    in_channels=3,
    latent_channels=4,
    attention_head_dim=4,
    encoder_block_types=("ResBlock", "EfficientViTBlock"),
    decoder_block_types=("ResBlock", "EfficientViTBlock"),
    encoder_block_out_channels=(8, 16),
    decoder_block_out_channels=(8, 16),
    encoder_layers_per_block=(1, 1),
    decoder_layers_per_block=(1, 1),
    encoder_qkv_multiscales=((), (5,)),
    decoder_qkv_multiscales=((), (5,)),
    upsample_block_type="interpolate",
    downsample_block_type="conv",
    decoder_norm_types="rms_norm",
    decoder_act_fns="silu",
    scaling_factor=0.5,
)


# 4 stages: 8 times smaller per side, for training on 128-pixel buckets at a few hundred tokens
TINY_DC_AE_F8 = dict(
    TINY_DC_AE,
    encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",),
    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",),
    encoder_block_out_channels=(4, 8, 8, 16),
    decoder_block_out_channels=(4, 8, 8, 16),
    encoder_layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    encoder_qkv_multiscales=((), (), (), (5,)),
    decoder_qkv_multiscales=((), (), (), (5,)),
)


def save_tiny_dc_ae(folder: Path, seed: int = 0, config: dict = TINY_DC_AE) -> Path:
    """An AutoencoderDC into 4 latent channels: TINY_DC_AE halves each side (2 stages)."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    AutoencoderDC(**config).save_pretrained(folder)
    return folder


def save_tiny_kl(folder: Path, seed: int = 0) -> Path:
    """An AutoencoderKL that halves each side into 4 latent channels, with a shift factor."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        scaling_factor=0.3,
        shift_factor=0.1,
    ).save_pretrained(folder)
    return folder


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A smooth random RGB picture (so resampling differences show) encoded as PNG or JPEG."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(3, 4, 4, generator=generator)
    pixels = torch.nn.functional.interpolate(coarse[None], size=(height, width), mode="bilinear")[0]
    array = (pixels * 255).round().byte().permute(1, 2, 0).numpy()
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()
