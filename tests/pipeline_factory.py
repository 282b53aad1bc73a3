"""A tiny diffusers Sana pipeline folder, as Sana's releases lay one out (model_index.json, transformer/, vae/,
text_encoder/ + tokenizer/, scheduler/), written with diffusers' own save_pretrained from seeded weights."""

from pathlib import Path

import torch
from encoder_factory import save_tiny_dc_ae, save_tiny_gemma2

from sana2.components.schedulers import build_scheduler, scheduler_config
from sana2.distributed.initialize import init_weights
from sana2.formats.diffusers import diffusers_config, export_pieces
from sana2.models import build_model

MODEL = "SanaMS_debug"  # 4 latent channels (the tiny DC-AE's), captions 32 wide (the tiny Gemma-2's)
FLOW_SHIFT = 3.0


def exported_transformer(seed: int = 5):
    """A seeded sana2 model and diffusers' SanaTransformer2DModel loaded strictly from its export."""
    from diffusers import SanaTransformer2DModel

    model = build_model(MODEL).eval()
    init_weights(model, seed=seed)
    exported = {
        piece.name: piece.take(tensor).clone()
        for key, tensor in model.state_dict().items()
        for piece in export_pieces(key, False)
    }
    reference = SanaTransformer2DModel.from_config(diffusers_config(MODEL, {})).eval()
    reference.load_state_dict(exported, strict=True)
    return model, reference


def save_tiny_pipeline(root: Path, scheduler: str = "dpm-solver", work: Path | None = None) -> Path:
    """SanaPipeline(...).save_pretrained(root) of tiny seeded components; returns root."""
    from diffusers import AutoencoderDC, SanaPipeline
    from transformers import AutoTokenizer, Gemma2Model

    work = work or root.parent / f"{root.name}-parts"
    gemma = save_tiny_gemma2(work / "gemma")
    _, transformer = exported_transformer()
    with torch.random.fork_rng(devices=[]):
        pipeline = SanaPipeline(
            tokenizer=AutoTokenizer.from_pretrained(gemma),
            text_encoder=Gemma2Model.from_pretrained(gemma),
            vae=AutoencoderDC.from_pretrained(save_tiny_dc_ae(work / "vae")),
            transformer=transformer,
            scheduler=build_scheduler(scheduler_config(scheduler, FLOW_SHIFT)),
        )
    pipeline.save_pretrained(root)
    return root
