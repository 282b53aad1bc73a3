"""What online mode's frozen text encoder holds while it encodes one micro-batch's captions, from its config.

`[data] mode = "online"` encodes each micro-batch's captions on the training rank before the step
(sana2/data/shard_encoding.py's `encode_batch`), under no_grad: the token ids and mask, the encoder's largest set
of live activations (for Gemma-2 with Sana's instruction, 1,096 tokens per caption: its attention scores and MLP),
and the float32 embeddings. The encoder is built on the meta device from its config.json and run there on a
batch of the same sequence length (sana2/encoders/text_encoder.py's `sequence_length`, the tokenizer counting the
instruction), while `LiveBytes(meta=True)` counts the bytes of every tensor it creates and frees, as
sana2/planning/vae_encode.py does for the VAE. The meta run gets no attention mask (building it from a padding
mask reads the mask's values, which a meta tensor has not): what the mask adds is its own int64 tensor, which
is counted, and nothing else on the fused-attention path.

Sharded over N data-parallel ranks (encoding.shard_text_encoder, sana2/distributed/frozen_encoder.py), a
forward also holds a layer's gathered weights and the previous layer's all-gather output until the next
gather frees it (two layers, as the DiT's blocks are counted), and the vocabulary-parallel lookup holds every
rank's rows of the batch at once ([N, B, L, C], twice while it masks them): both counted from the config.
"""

import functools
from dataclasses import dataclass

import torch

from sana2.distributed.frozen_encoder import layer_list
from sana2.encoders.text_encoder import empty_text_encoder, load_tokenizer, resolve_instruction, sequence_length
from sana2.planning.live_bytes import LiveBytes
from sana2.planning.vae_encode import EncodeCost, FusedAttention


@dataclass(frozen=True)
class _Shape:
    length: int  # tokens per caption
    width: int  # hidden size
    layer_bytes: int  # the largest layer's weights, whole
    itemsize: int


def encode_peak(model, batch: int, length: int) -> int:
    """Peak live tensor bytes of `model`'s forward (on the meta device) on `batch` captions of `length` tokens,
    the ids and mask and the float32 embeddings included."""
    with torch.no_grad(), FusedAttention(), LiveBytes(meta=True) as live:
        ids = torch.zeros(batch, length, dtype=torch.long, device="meta")
        mask = torch.ones(batch, length, dtype=torch.long, device="meta")
        hidden = model(input_ids=ids).last_hidden_state
        embeds = hidden.float()
        del ids, mask, hidden, embeds
    return live.peak


def text_encode_cost(encoding, caption_length: int, shards: int) -> EncodeCost:
    """The encode cost of [encoding]'s text encoder on captions of `caption_length` tokens (the model's
    model_max_length), whole on each rank (`shards` 1) or sharded over `shards` ranks."""
    shards = shards if encoding.shard_text_encoder else 1
    return _text_encode_cost(encoding.text_encoder, encoding.instruction, encoding.dtype, caption_length, shards)


@functools.lru_cache(maxsize=16)  # a plan's suggestions ask for the same one at other batch sizes
def _text_encode_cost(name: str, instruction: str, dtype_name: str, caption_length: int, shards: int):
    dtype = getattr(torch, dtype_name)
    length = sequence_length(load_tokenizer(name), resolve_instruction(name, instruction), caption_length)
    model = empty_text_encoder(name, dtype).to("meta").eval()
    layer_bytes = max(sum(p.numel() for p in layer.parameters()) for layer in layer_list(model)) * dtype.itemsize
    shape = _Shape(length, model.config.hidden_size, layer_bytes, dtype.itemsize)
    one, two = (_sharded(encode_peak(model, batch, length), shape, batch, shards) for batch in (1, 2))
    what = f"{type(model).__name__}, {length} tokens per caption, {dtype_name}"
    if shards > 1:
        what += f", sharded over {shards} ranks"
    return EncodeCost(one, two - one, what)


def _sharded(whole_peak: int, shape: _Shape, batch: int, shards: int) -> int:
    """The peak of a forward sharded over `shards` ranks: the whole model's, plus two gathered layers, or the
    vocabulary-parallel lookup's if that is larger."""
    if shards == 1:
        return whole_peak
    tokens = batch * shape.length
    ids = 2 * tokens * 8  # the ids and the mask, int64
    every_rows = shards * tokens * shape.width * shape.itemsize  # [N, B, L, C]: every rank's tokens
    lookup = ids + shards * tokens * 8 + 2 * every_rows + tokens * shape.width * shape.itemsize  # + this rank's
    return max(whole_peak + 2 * shape.layer_bytes, lookup)
