"""Caption encoders: captions -> (per-token embeddings, attention mask), padded to a fixed length.

Two kinds:
  * "tiny-t5": a 2-layer, 64-wide T5 encoder with a byte-level tokenizer (ByT5), built in-process from
    a fixed seed. It needs no download and no vocabulary file, so tests and the default CPU run use it.
    Its weights are drawn by sana2 itself (not by transformers' initialiser), so they are the same on
    every call, machine and transformers release.
  * any other name: a local directory holding a Hugging Face tokenizer and model, loaded without network
    access: a T5 encoder (an encoder-decoder checkpoint is loaded as its encoder), or a decoder-only
    language model such as Gemma-2, Sana's text encoder (loaded as its base model, without the LM head).
    Its last hidden state is the embedding.

Sana's rules for a decoder-only encoder (its training, inference and the diffusers Sana pipeline agree):
  * each caption is prefixed with the "complex human instruction" (CHI: the lines of `SANA_INSTRUCTION`
    joined by newlines), so that the causal model's states for the caption have read the instruction;
  * the prefixed text is tokenised to num_instruction_tokens + max_length - 2 tokens (right-padded or
    truncated), where num_instruction_tokens counts the instruction's tokens with the leading BOS;
  * of that sequence, the first token (BOS) and the last max_length - 1 tokens are kept: max_length
    embeddings per caption, the mask cut the same way.
Without an instruction the sequence is max_length tokens and the rule keeps all of them; a T5 encoder
takes no instruction. The null caption (for classifier-free dropout) is the empty prompt tokenised to
max_length without the instruction, as Sana computes it.

`build_text_encoder(..., mesh=...)` shards the frozen encoder over the data-parallel ranks
(sana2/distributed/frozen_encoder.py); from a local directory each rank then reads only its own rows of
the safetensors weights, so no rank ever holds the whole model.
"""

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from sana2.distributed.frozen_encoder import local_rows, shard_frozen_encoder

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


# Sana's complex human instruction (its configs' text_encoder.chi_prompt), one entry per line
SANA_INSTRUCTION_LINES = (
    'Given a user prompt, generate an "Enhanced prompt" that provides detailed visual descriptions suitable for '
    "image generation. Evaluate the level of detail in the user prompt:",
    "- If the prompt is simple, focus on adding specifics about colors, shapes, sizes, textures, and spatial "
    "relationships to create vivid and concrete scenes.",
    "- If the prompt is already detailed, refine and enhance the existing details slightly without overcomplicating.",
    "Here are examples of how to transform or refine prompts:",
    "- User Prompt: A cat sleeping -> Enhanced: A small, fluffy white cat curled up in a round shape, sleeping "
    "peacefully on a warm sunny windowsill, surrounded by pots of blooming red flowers.",
    "- User Prompt: A busy city street -> Enhanced: A bustling city street scene at dusk, featuring glowing street "
    "lamps, a diverse crowd of people in colorful clothing, and a double-decker bus passing by towering glass "
    "skyscrapers.",
    "Please generate only the enhanced description for the prompt below and avoid including any additional "
    "commentary or evaluations:",
    "User Prompt: ",
)
SANA_INSTRUCTION = "\n".join(SANA_INSTRUCTION_LINES)
# encoder-only models (no causal attention): they take no instruction prefix
ENCODER_MODEL_TYPES = {"t5", "mt5", "umt5"}


class TextEncoder:
    """A tokenizer and an encoder model that turn captions into fixed-length embeddings."""

    def __init__(
        self,
        tokenizer,
        model: nn.Module,
        max_length: int,
        device: torch.device | str = "cpu",
        instruction: str | None = None,
    ):
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.max_length = max_length
        self.device = torch.device(device)
        self.model_type = model.config.model_type
        if instruction and self.model_type in ENCODER_MODEL_TYPES:
            raise ValueError(
                f"an instruction prefix is for decoder-only text encoders (Gemma-2); this one is {self.model_type!r}"
            )
        self.instruction = instruction or None
        self.instruction_tokens = len(tokenizer.encode(self.instruction)) if self.instruction else 0
        self.sequence_length = sequence_length(tokenizer, self.instruction, max_length)

    @property
    def dim(self) -> int:
        """Width C of each token embedding."""
        return self.model.config.hidden_size

    @torch.no_grad()
    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings float32 [B, max_length, dim] and mask int64 [B, max_length] (1 = real token).

        Captions are right-padded (and truncated); padding positions keep whatever the encoder produced
        there, as in Sana, and are excluded by the mask in cross-attention. A decoder-only encoder with an
        instruction follows Sana's prefix-and-cut rule (module docstring).
        """
        if isinstance(captions, str):
            raise TypeError("encode takes a list of captions, not a single string")
        texts = [self.instruction + caption for caption in captions] if self.instruction else list(captions)
        return self._encode(texts, self.sequence_length)

    @torch.no_grad()
    def null_caption(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty prompt's embeddings float32 [max_length, dim] and mask int64 [max_length] (no instruction)."""
        embeds, mask = self._encode([""], self.max_length)
        return embeds[0], mask[0]

    def _encode(self, texts: list[str], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")
        input_ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        embeds = _first_and_last(hidden.float(), self.max_length)
        return embeds.cpu(), _first_and_last(mask.long(), self.max_length).cpu()


def sequence_length(tokenizer, instruction: str | None, max_length: int) -> int:
    """Tokens the encoder runs on per caption: `max_length`, or with an instruction its tokens plus
    `max_length` - 2 (Sana's prefix-and-cut rule: the first token and the last `max_length` - 1 are kept)."""
    return len(tokenizer.encode(instruction)) + max_length - 2 if instruction else max_length


def load_tokenizer(name: str):
    """The tokenizer of text encoder `name` ("tiny-t5" or a local folder), as `build_text_encoder` loads it."""
    if name == TINY_T5:
        return _byte_tokenizer()
    check_text_encoder_name(name)
    return _local_tokenizer(Path(name))


def _first_and_last(sequence: torch.Tensor, max_length: int) -> torch.Tensor:
    """Positions 0 and the last max_length - 1 of dim 1 (all of them when the sequence is max_length long)."""
    if sequence.shape[1] == max_length:
        return sequence
    if max_length == 1:
        return sequence[:, :1]
    return torch.cat([sequence[:, :1], sequence[:, -(max_length - 1) :]], dim=1)


def build_text_encoder(
    name: str,
    max_length: int,
    seed: int = 0,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    instruction: str | None = None,
    mesh: DeviceMesh | None = None,
) -> TextEncoder:
    """ "tiny-t5" (seeded, built in-process) or a local Hugging Face model directory.

    `seed` only affects "tiny-t5"; `device`/`dtype` place a real encoder (e.g. bf16 on a GPU);
    `instruction` prefixes captions for a decoder-only encoder (e.g. SANA_INSTRUCTION); `mesh` (1-D, the
    data-parallel ranks) shards the frozen encoder so that each rank holds 1/N of it.
    """
    tokenizer = load_tokenizer(name)
    if name == TINY_T5:
        model = _tiny_t5(seed).to(device=device, dtype=dtype)
        if mesh is not None:
            shard_frozen_encoder(model, mesh, dtype)
        return TextEncoder(tokenizer, model, max_length, device, instruction)
    path = Path(name)
    model = _local_model(path, dtype, device) if mesh is None else _sharded_local_model(path, mesh, dtype, device)
    return TextEncoder(tokenizer, model, max_length, device, instruction)


def check_text_encoder_name(name: str) -> None:
    """`name` is "tiny-t5" or a local folder (nothing is downloaded); else FileNotFoundError naming it. What a
    run checks before it starts, whether or not it will load the encoder."""
    if name != TINY_T5 and not Path(name).is_dir():
        raise FileNotFoundError(
            f"text encoder {name!r}: no such directory (expected '{TINY_T5}' or a local Hugging Face model "
            f"directory with config.json and tokenizer files; nothing is downloaded)"
        )


def resolve_instruction(name: str, instruction: str) -> str | None:
    """The caption prefix for encoder `name`: "auto" is Sana's instruction for a decoder-only encoder (Gemma-2)
    and none for an encoder-only one (T5, tiny-t5); "none" is none; anything else is the prefix itself."""
    if instruction == "auto":
        return None if _is_encoder_only(name) else SANA_INSTRUCTION
    return None if instruction == "none" else instruction


def _is_encoder_only(name: str) -> bool:
    if name == TINY_T5:
        return True
    config = Path(name) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in ENCODER_MODEL_TYPES


def store_null_caption(model: nn.Module, caption_embeds: torch.Tensor) -> None:
    """Make `caption_embeds` [L, C_cap] (the empty prompt's embedding) the model's null caption.

    The DiT swaps it in for the captions that classifier-free dropout drops; it is the buffer
    `y_embedder.y_embedding`, so every checkpoint carries it and a resumed run needs no separate file.
    Call it on every rank after the model's weights are initialised (FSDP leaves buffers whole).
    """
    buffer = model.get_buffer("y_embedder.y_embedding")
    if tuple(buffer.shape) != tuple(caption_embeds.shape):
        raise ValueError(
            f"null caption of shape {tuple(caption_embeds.shape)} does not fit the model's "
            f"[model_max_length, caption_channels] = {list(buffer.shape)}"
        )
    with torch.no_grad():
        buffer.copy_(caption_embeds.to(device=buffer.device, dtype=buffer.dtype))


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


# A tokenizer's vocabulary is in one of these (fast tokenizers, SentencePiece as Gemma's and T5's, BPE,
# WordPiece); tokenizer_config.json alone gives transformers an almost empty tokenizer, silently.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
VOCABULARY_FREE = {"ByT5Tokenizer"}  # byte-level: no vocabulary file


def tokenizer_folder(path: Path) -> Path:
    """The folder holding the tokenizer of the text encoder in `path`: `path` itself, else, in a diffusers
    pipeline (text_encoder/ and tokenizer/ side by side), its sibling tokenizer/. Anything else is refused,
    naming the folder and the files it lacks."""
    for folder in (path, path.parent / "tokenizer"):
        if any((folder / name).is_file() for name in VOCABULARY_FILES):
            return folder
        try:
            declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            declared = None
        if declared in VOCABULARY_FREE:
            return folder
    raise ValueError(
        f"text encoder {path}: no tokenizer files (expected tokenizer_config.json with one of "
        f"{', '.join(VOCABULARY_FILES)} in {path}, or in {path.parent / 'tokenizer'} beside it as a diffusers "
        f"pipeline keeps them); without them every caption would encode the same"
    )


def _local_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder(path), local_files_only=True)
    tokenizer.padding_side = "right"  # the mask marks the real tokens first, padding last, as Sana expects
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _model_class(config):
    """An encoder-decoder checkpoint (T5) loads as its encoder only; a decoder-only LM (Gemma-2) as its base
    model without the LM head, whose last hidden state Sana uses."""
    from transformers import AutoModel, AutoModelForTextEncoding

    return AutoModelForTextEncoding if config.model_type in ENCODER_MODEL_TYPES else AutoModel


def _local_model(path: Path, dtype: torch.dtype, device) -> nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    model = _model_class(config).from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.requires_grad_(False).to(device)


def empty_text_encoder(name: str | Path, dtype: torch.dtype) -> nn.Module:
    """Text encoder `name` ("tiny-t5" or a local folder) as it loads, built from its config alone: parameters on
    the meta device (nothing allocated, no weights read), buffers (e.g. rotary frequencies) real."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, T5Config, T5EncoderModel

    with init_empty_weights(include_buffers=False):
        if str(name) == TINY_T5:
            return T5EncoderModel(T5Config(**TINY_T5_CONFIG)).to(dtype)
        config = AutoConfig.from_pretrained(name, local_files_only=True)
        return _model_class(config).from_config(config, dtype=dtype)


def _sharded_local_model(path: Path, mesh: DeviceMesh, dtype: torch.dtype, device) -> nn.Module:
    """Build the model without weights, shard it, and fill each rank's shards from the safetensors files."""
    model = empty_text_encoder(path, dtype)
    shard_frozen_encoder(model, mesh, dtype)
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    model.to_empty(device=device)  # allocates this rank's shards only
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
        _fill_local_shards(model, path)
    return model


def _fill_local_shards(model: nn.Module, path: Path) -> None:
    """Copy each parameter's local rows from the model folder's safetensors file(s), reading only those rows."""
    from sana2.formats.safetensors_file import read_safetensors_checkpoint
    from sana2.formats.tensors import CheckpointError

    try:
        stored = {tensor.name: tensor for tensor in read_safetensors_checkpoint(path)}
    except CheckpointError as exc:
        raise ValueError(f"text encoder {path}: a sharded encoder reads safetensors weights: {exc}") from None
    prefix = f"{model.base_model_prefix}."
    missing = [name for name, _ in model.named_parameters() if name not in stored and prefix + name not in stored]
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise ValueError(f"text encoder {path}: the weights lack {shown}")
    for name, param in model.named_parameters():
        tensor = stored[name if name in stored else prefix + name]
        if list(tensor.shape) != list(param.shape):
            shapes = f"has shape {list(tensor.shape)}, the model needs {list(param.shape)}"
            raise ValueError(f"text encoder {path}: {tensor.name} {shapes}")
        start, _ = local_rows(param)
        tensor.read_into(param.to_local(), start)  # converted to the parameter's dtype as it is copied
