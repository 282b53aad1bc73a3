"""Caption encoders: captions -> (per-token embeddings, attention mask), padded to a fixed length.

Two kinds:
  * "tiny-t5": a 2-layer, 64-wide T5 encoder with a byte-level tokenizer (ByT5), built in-process from
    a fixed seed. It needs no download and no vocabulary file, so tests and the default CPU run use it.
    Its weights are drawn by sana2 itself (not by transformers' initialiser), so they are the same on
    every call, machine and transformers release.
  * any other name: a local directory holding a Hugging Face tokenizer and model (e.g. Gemma-2 as Sana
    uses, or a T5 encoder), loaded without network access. Its last hidden state is the embedding.
"""

import math
from pathlib import Path

import torch
from torch import nn

TINY_T5 = "tiny-t5"

# The tiny T5: C = 64 to match SanaMS_digits' caption_channels; 384 = ByT5's 256 bytes + 3 specials + 125 extra ids.
TINY_T5_CONFIG = dict(
    vocab_size=384,
    d_model=64,
    d_kv=32,
    d_ff=128,
    num_layers=2,
    num_heads=2,
    relative_attention_num_buckets=32,
    dropout_rate=0.0,
    feed_forward_proj="relu",
    is_encoder_decoder=False,
    use_cache=False,
)


class TextEncoder:
    """A tokenizer and an encoder model that turn captions into fixed-length embeddings."""

    def __init__(self, tokenizer, model: nn.Module, max_length: int, device: torch.device | str = "cpu"):
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.max_length = max_length
        self.device = torch.device(device)

    @property
    def dim(self) -> int:
        """Width C of each token embedding."""
        return self.model.config.hidden_size

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings float32 [B, max_length, dim] and mask int64 [B, max_length] (1 = real token).

        Captions are right-padded (and truncated) to max_length; padding positions keep whatever the
        encoder produced there, as in Sana, and are excluded by the mask in cross-attention.
        """
        if isinstance(captions, str):
            raise TypeError("encode takes a list of captions, not a single string")
        tokens = self.tokenizer(
            list(captions), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        input_ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return hidden.float().cpu(), mask.long().cpu()


def build_text_encoder(
    name: str, max_length: int, seed: int = 0, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> TextEncoder:
    """ "tiny-t5" (seeded, built in-process) or a local Hugging Face model directory.

    `seed` only affects "tiny-t5"; `device`/`dtype` place a real encoder (e.g. bf16 on a GPU).
    """
    if name == TINY_T5:
        return TextEncoder(_byte_tokenizer(), _tiny_t5(seed), max_length)
    return _local_encoder(Path(name), max_length, device, dtype)


def _byte_tokenizer():
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    tokenizer.padding_side = "right"
    return tokenizer


def _tiny_t5(seed: int) -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    # transformers' own initialiser draws from the global RNG: keep the caller's RNG state untouched
    with torch.random.fork_rng(devices=[]):
        model = T5EncoderModel(T5Config(**TINY_T5_CONFIG))
    _seeded_t5_init(model, seed)
    return model.eval()


@torch.no_grad()
def _seeded_t5_init(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter from one generator, in parameter-name order.

    Tied weights appear once in named_parameters(), so each tensor is drawn exactly once.
    """
    generator = torch.Generator().manual_seed(seed)
    owners = {
        f"{module_name}.{leaf}" if module_name else leaf: module
        for module_name, module in model.named_modules()
        for leaf, _ in module.named_parameters(recurse=False)
    }
    for name, param in sorted(model.named_parameters()):
        module = owners[name]
        if param.dim() == 1:  # T5's RMS layer norms (T5 layers have no biases)
            value = torch.ones(param.shape)
        elif isinstance(module, nn.Embedding):
            # token embeddings at unit scale (T5's convention); small relative-position biases so that
            # attention starts close to content-based
            std = 0.1 if "relative_attention_bias" in name else 1.0
            value = torch.randn(param.shape, generator=generator) * std
        elif isinstance(module, nn.Linear):
            value = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1])
        else:
            raise ValueError(f"tiny-t5: no initialisation rule for {name} ({type(module).__name__})")
        param.copy_(value)


def _local_encoder(path: Path, max_length: int, device, dtype: torch.dtype) -> TextEncoder:
    if not path.is_dir():
        raise FileNotFoundError(
            f"text encoder {str(path)!r}: no such directory (expected '{TINY_T5}' or a local Hugging Face model "
            f"directory with config.json and tokenizer files; nothing is downloaded)"
        )
    from transformers import AutoConfig, AutoModel, AutoModelForTextEncoding, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "right"  # the mask marks the real tokens first, padding last, as Sana expects
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    # an encoder-decoder checkpoint (T5) is loaded as its encoder only; a decoder-only LM (Gemma-2) as its
    # base model without the LM head, whose last hidden state Sana uses
    loader = AutoModelForTextEncoding if config.is_encoder_decoder else AutoModel
    model = loader.from_pretrained(path, local_files_only=True, dtype=dtype).to(device)
    return TextEncoder(tokenizer, model, max_length, device)
