"""Text encoders from local folders: Sana's rules for Gemma-2 (instruction prefix, first token + last max_length - 1),
T5 encoders, the null caption, and the frozen encoder sharded over ranks."""

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from dist_utils import run_distributed
from encoder_factory import save_tiny_gemma2, save_tiny_t5
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from sana2.distributed.frozen_encoder import parameter_bytes
from sana2.distributed.initialize import init_weights
from sana2.encoders.text_encoder import SANA_INSTRUCTION, build_text_encoder, store_null_caption
from sana2.models.registry import build_model

L = 12
INSTRUCTION = "Describe: "


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return save_tiny_gemma2(tmp_path_factory.mktemp("gemma"))


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return save_tiny_t5(tmp_path_factory.mktemp("t5"))


def unpadded_states(encoder, text: str) -> torch.Tensor:
    """The model's last hidden state for `text` alone: no padding, no truncation, nothing cut."""
    tokens = encoder.tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        return encoder.model(**tokens).last_hidden_state[0]


def test_gemma2_keeps_bos_and_the_last_max_length_minus_one_tokens_of_the_prefixed_caption(gemma_dir):
    encoder = build_text_encoder(str(gemma_dir), L, instruction=INSTRUCTION)
    assert encoder.model_type == "gemma2" and encoder.dim == 32
    assert encoder.instruction_tokens == 1 + len(INSTRUCTION)  # BOS + one token per character
    caption = "a red cat"
    embeds, mask = encoder.encode([caption])
    assert embeds.shape == (1, L, 32) and mask.shape == (1, L)
    # kept: BOS, the instruction's last token, the caption; then padding
    real = 2 + len(caption)
    assert mask[0].tolist() == [1] * real + [0] * (L - real)
    full = unpadded_states(encoder, INSTRUCTION + caption)  # 1 + 10 + 9 tokens
    first_kept = encoder.instruction_tokens - 1
    expected = torch.cat([full[:1], full[first_kept:]])
    torch.testing.assert_close(embeds[0, :real], expected, atol=1e-5, rtol=1e-5)
    # the caption's states have read the instruction (causal attention over the prefix)
    plain = build_text_encoder(str(gemma_dir), L).encode([caption])[0]
    assert not torch.allclose(plain[0, 2:real], embeds[0, 2:real], atol=1e-3)


def test_gemma2_truncates_a_long_caption_at_its_end(gemma_dir):
    encoder = build_text_encoder(str(gemma_dir), L, instruction=INSTRUCTION)
    caption = "abcdefghijklmnopqrstuvwxyz"
    embeds, mask = encoder.encode([caption, "short"])
    assert mask[0].sum() == L and mask[1].sum() == 2 + len("short")
    full = unpadded_states(encoder, INSTRUCTION + caption[: L - 2])  # what survives truncation
    torch.testing.assert_close(embeds[0], torch.cat([full[:1], full[-(L - 1) :]]), atol=1e-5, rtol=1e-5)


def test_without_instruction_the_caption_is_padded_to_max_length(gemma_dir):
    encoder = build_text_encoder(str(gemma_dir), L)
    embeds, mask = encoder.encode(["hello"])
    assert mask[0].tolist() == [1] * 6 + [0] * (L - 6)  # BOS + 5 characters
    torch.testing.assert_close(embeds[0, :6], unpadded_states(encoder, "hello"), atol=1e-5, rtol=1e-5)


def test_sanas_instruction_is_its_eight_lines_and_prefixes_every_caption(gemma_dir):
    assert SANA_INSTRUCTION.count("\n") == 7 and SANA_INSTRUCTION.endswith("\nUser Prompt: ")
    assert SANA_INSTRUCTION.startswith('Given a user prompt, generate an "Enhanced prompt"')
    encoder = build_text_encoder(str(gemma_dir), 300, instruction=SANA_INSTRUCTION)
    embeds, mask = encoder.encode(["a cat", "x" * 400])
    assert embeds.shape == (2, 300, 32) and mask.sum(1).tolist() == [2 + 5, 300]


def test_null_caption_is_the_empty_prompt_without_the_instruction(gemma_dir, t5_dir):
    with_instruction = build_text_encoder(str(gemma_dir), L, instruction=INSTRUCTION)
    embeds, mask = with_instruction.null_caption()
    assert embeds.shape == (L, 32) and mask.tolist() == [1] + [0] * (L - 1)  # BOS only
    plain_embeds, plain_mask = build_text_encoder(str(gemma_dir), L).encode([""])
    assert torch.equal(embeds, plain_embeds[0]) and torch.equal(mask, plain_mask[0])
    t5 = build_text_encoder(str(t5_dir), L)
    t5_embeds, t5_mask = t5.null_caption()
    assert t5_mask.tolist() == [1] + [0] * (L - 1)  # EOS only
    assert torch.equal(t5_embeds, t5.encode([""])[0][0])


def test_null_caption_becomes_the_models_classifier_free_caption(gemma_dir):
    encoder = build_text_encoder(str(gemma_dir), 16, instruction=INSTRUCTION)
    model = build_model("SanaMS_debug", caption_channels=32, model_max_length=16).eval()
    init_weights(model, 0)
    null_embeds, _ = encoder.null_caption()
    store_null_caption(model, null_embeds)
    assert torch.equal(model.state_dict()["y_embedder.y_embedding"], null_embeds)  # saved with every checkpoint
    # a dropped caption is the null caption, whatever the caption was
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([500, 500])
    captions = encoder.encode(["a red cat", "a blue dog"])[0][:, None]
    dropped = model(x, t, captions, drop_ids=torch.tensor([True, True]))
    nulls = model(x, t, null_embeds.expand(2, 1, 16, 32))
    torch.testing.assert_close(dropped, nulls)
    with pytest.raises(
        ValueError, match=r"does not fit the model's \[model_max_length, caption_channels\] = \[16, 32\]"
    ):
        store_null_caption(model, null_embeds[:12])


def test_t5_loads_the_encoder_of_an_encoder_decoder_checkpoint(t5_dir):
    from transformers import T5ForConditionalGeneration

    encoder = build_text_encoder(str(t5_dir), L)
    assert type(encoder.model).__name__ == "T5EncoderModel"
    assert all(not p.requires_grad for p in encoder.model.parameters())
    embeds, mask = encoder.encode(["a dog"])
    full = T5ForConditionalGeneration.from_pretrained(t5_dir).eval()
    tokens = encoder.tokenizer(["a dog"], padding="max_length", max_length=L, return_tensors="pt")
    with torch.no_grad():
        expected = full.encoder(**tokens).last_hidden_state
    torch.testing.assert_close(embeds, expected, atol=1e-6, rtol=1e-6)
    assert mask.sum() == 6  # 5 characters + EOS
    with pytest.raises(ValueError, match="instruction prefix is for decoder-only text encoders"):
        build_text_encoder(str(t5_dir), L, instruction=INSTRUCTION)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def model_files_only(source, target):
    """A copy of an encoder folder without its tokenizer files (a pipeline's text_encoder/)."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return target


@pytest.mark.parametrize("kind", ["gemma", "t5"])
def test_a_folder_without_tokenizer_files_is_refused_naming_it(kind, gemma_dir, t5_dir, tmp_path):
    bare = model_files_only(gemma_dir if kind == "gemma" else t5_dir, tmp_path / "text_encoder")
    with pytest.raises(ValueError, match=f"text encoder {bare}: no tokenizer files .*tokenizer.json, tokenizer.model"):
        build_text_encoder(str(bare), L)


def test_a_pipelines_text_encoder_reads_the_tokenizer_beside_it(gemma_dir, tmp_path):
    pipeline = tmp_path / "pipeline"
    model_files_only(gemma_dir, pipeline / "text_encoder")
    (pipeline / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (gemma_dir / name).is_file():
            shutil.copy(gemma_dir / name, pipeline / "tokenizer" / name)
    captions = ["a dog", "two cats on a mat"]
    embeds, mask = build_text_encoder(str(pipeline / "text_encoder"), L, instruction=INSTRUCTION).encode(captions)
    expected, expected_mask = build_text_encoder(str(gemma_dir), L, instruction=INSTRUCTION).encode(captions)
    torch.testing.assert_close(embeds, expected, atol=0, rtol=0)
    assert torch.equal(mask, expected_mask)
    assert not torch.allclose(embeds[0], embeds[1])


def test_encoders_load_in_bf16(gemma_dir):
    encoder = build_text_encoder(str(gemma_dir), L, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in encoder.model.parameters())
    assert encoder.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their own precision
    embeds, _ = encoder.encode(["x"])
    assert embeds.dtype == torch.float32  # handed out in float32 whatever the model computes in


# ---------------------------------------------------------------------------------------------
# Sharded over ranks


CAPTIONS = ["a red cat", "", "a much longer caption than the others, which is cut"]


def _sharded_equals_unsharded(rank, world_size, folders):
    mesh = init_device_mesh("cpu", (world_size,))
    captions = CAPTIONS[rank:]  # ranks encode different captions, and different numbers of them
    for folder, instruction in folders:
        full = build_text_encoder(folder, L, dtype=torch.bfloat16, instruction=instruction)
        sharded = build_text_encoder(folder, L, dtype=torch.bfloat16, instruction=instruction, mesh=mesh)
        params = list(sharded.model.parameters())
        assert all(isinstance(p, DTensor) and not p.requires_grad and p.dtype == torch.bfloat16 for p in params)
        assert parameter_bytes(sharded.model) * world_size == parameter_bytes(full.model), folder
        expected, got = full.encode(captions), sharded.encode(captions)
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1]), folder
        assert parameter_bytes(sharded.model) * world_size == parameter_bytes(full.model)  # a forward adds none
        assert all(torch.equal(a, b) for a, b in zip(full.null_caption(), sharded.null_caption()))
    # tiny-t5, built in-process, shards the same way
    tiny_full = build_text_encoder("tiny-t5", L, dtype=torch.bfloat16)
    tiny_sharded = build_text_encoder("tiny-t5", L, dtype=torch.bfloat16, mesh=mesh)
    assert torch.equal(tiny_full.encode(captions)[0], tiny_sharded.encode(captions)[0])


@pytest.mark.slow
def test_sharded_text_encoder_gives_the_unsharded_embeddings_at_half_the_memory(gemma_dir, t5_dir):
    folders = [(str(gemma_dir), INSTRUCTION), (str(t5_dir), None)]
    run_distributed(_sharded_equals_unsharded, 2, folders)
