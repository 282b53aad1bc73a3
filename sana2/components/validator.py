"""Periodic validation: sample fixed prompts into a TensorBoard image grid, and a held-out loss.

Every rank takes part in every forward of the sharded model (no rank gathers the full model) and
samples the same images from the same seeded noise; rank 0 logs them.
"""

import importlib.util
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sana2.components.text_encoder import build_text_encoder
from sana2.components.validation import euler_sample, sampling_noise, validation_loss
from sana2.config import ConfigError
from sana2.data.features import FeatureDataset
from sana2.distributed.utils import RunOnRank0Error, reshard, run_on_rank0
from sana2.log import logger


class Validator:
    def __init__(
        self,
        config,
        model,
        ema,
        metrics_logger,
        val_dir: Path | None,
        latent_shape: tuple[int, ...],
    ):
        """Samples `latent_shape` latents; the held-out loss reads `val_dir` (None: no loss)."""
        device = model.null_caption().device  # the compute device (parameters may be offloaded)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.settings = config.validation
        self.flow_shift = config.training.flow_shift
        self.model, self.ema, self.metrics, self.device = model, ema, metrics_logger, device
        prompts = [p for p in self.settings.prompts for _ in range(self.settings.images_per_prompt)]
        embeds, mask = _encode_on_rank0(config, prompts)
        caption_shape = model.caption_shape
        if tuple(embeds.shape[1:]) != caption_shape:
            raise ConfigError(
                f"{config.source}: data.text_encoder = {config.data.text_encoder!r} with "
                f"data.caption_length = {config.data.caption_length} gives caption embeddings of "
                f"{tuple(embeds.shape[1:])} (tokens, width); the model takes {caption_shape}: use "
                f"the encoder and length the data was made with"
            )
        self.caption_embeds = embeds[:, None].to(device)
        self.caption_mask = mask.to(device)
        self.noise = sampling_noise(self.settings.seed, len(prompts), tuple(latent_shape)).to(device)
        self.loss_batches = self._loss_batches(val_dir, rank, world_size, config, latent_shape)
        self.rank = rank
        if self.settings.vae:
            _check_vae(self.settings.vae, config.source)
        # only rank 0 logs images, so only rank 0 holds and runs the VAE
        self.vae = _load_vae(self.settings.vae, device) if self.settings.vae and rank == 0 else None

    def _loss_batches(self, val_dir, rank, world_size, config, latent_shape) -> list[dict]:
        if val_dir is None or self.settings.num_loss_samples == 0:
            return []
        dataset = FeatureDataset(val_dir)
        if dataset.latent_shape != tuple(latent_shape) or (dataset.caption_length, dataset.caption_dim) != tuple(
            self.caption_embeds.shape[2:]
        ):
            raise ConfigError(
                f"{config.source}: data.val_path {val_dir} holds latents {dataset.latent_shape} and "
                f"captions {(dataset.caption_length, dataset.caption_dim)}; training uses "
                f"{tuple(latent_shape)} and {tuple(self.caption_embeds.shape[2:])}"
            )
        batch_size = config.training.local_batch_size
        count = min(self.settings.num_loss_samples, len(dataset)) // world_size * world_size
        mine = list(range(rank, count, world_size))  # equal counts: every rank runs the same forwards
        batches = []
        for start in range(0, len(mine), batch_size):
            batch = dataset.get_batch(mine[start : start + batch_size])
            batch["indices"] = torch.tensor(mine[start : start + batch_size])
            batches.append({k: v.to(self.device) for k, v in batch.items()})
        return batches

    def run(self, step: int) -> dict[str, float]:
        use_ema = self.settings.use_ema and self.ema is not None
        with self.ema.weights_swapped_in() if use_ema else nullcontext():
            images = euler_sample(
                self.model,
                self.noise,
                self.caption_embeds,
                self.caption_mask,
                self.settings.sampling_steps,
                self.settings.cfg_scale,
                self.flow_shift,
            )
            loss = (
                validation_loss(self.model, self.loss_batches, tuple(self.settings.loss_sigmas), self.settings.seed)
                if self.loss_batches
                else None
            )
            if use_ema:  # blocks kept unsharded after the no-grad forward would hold EMA weights
                reshard(self.model)
        self.last_images = images
        if self.rank != 0:
            return {"validation/loss": loss} if loss is not None else {}
        if self.vae is not None:
            images = _decode(self.vae, images)
        shown = displayable(images.float().clamp(-1, 1).cpu())
        if shown.shape[-1] < 64:  # enlarge tiny samples (8x8 digits) so TensorBoard shows them legibly
            shown = F.interpolate(shown, scale_factor=64 // shown.shape[-1], mode="nearest")
        self.metrics.images("validation/images", shown, step, nrow=self.settings.images_per_prompt)
        results = {"validation/loss": loss} if loss is not None else {}
        if results:
            self.metrics.scalars(step, results)
            logger.info(f"step {step}: validation loss {loss:.4f}")
        return results


def displayable(images: torch.Tensor) -> torch.Tensor:
    """[N, 1 or 3, H, W] for TensorBoard: the first frame of a video, the first channel of latents
    that no VAE decodes (a rough but honest view of what the model produces)."""
    if images.dim() == 5:
        images = images[:, :, 0]
    if images.shape[1] not in (1, 3):
        images = images[:, :1]
    return images


def _encode_on_rank0(config, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 loads the text encoder (a real one is large) and sends the embeddings to all ranks."""
    try:
        return run_on_rank0(
            lambda: build_text_encoder(config.data.text_encoder, config.data.caption_length).encode(prompts),
            lambda exc: f"{config.source}: data.text_encoder = {config.data.text_encoder!r} cannot be loaded: {exc}",
        )
    except RunOnRank0Error as exc:
        raise ConfigError(str(exc)) from None


def _check_vae(path: str, source: str) -> None:
    if importlib.util.find_spec("diffusers") is None:
        raise ConfigError(f"{source}: validation.vae = {path!r} needs the diffusers package (pip install diffusers)")
    if not Path(path).exists():
        raise ConfigError(f"{source}: validation.vae = {path!r} does not exist")


def _load_vae(path: str, device: torch.device):
    from diffusers import AutoencoderDC

    return AutoencoderDC.from_pretrained(path, local_files_only=True).to(device).eval()


@torch.no_grad()
def _decode(vae, latents: torch.Tensor) -> torch.Tensor:
    scaling = getattr(vae.config, "scaling_factor", 1.0)
    return vae.decode(latents.to(vae.dtype) / scaling).sample
