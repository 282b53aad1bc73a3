"""Periodic validation: sample fixed prompts (through diffusers' schedulers, as SanaPipeline does) into a
TensorBoard image grid and one file per sample, and a held-out loss.

Every rank takes part in every forward of the sharded model (no rank gathers the full model) and
samples the same images from the same seeded noise; rank 0 logs them.

Every sample is also written to <dump_folder>/samples/step-<N>/, named after its prompt as
`sana2-sample` names it (sana2/components/sample_files.py): a PNG per image as TensorBoard shows it, an
.mp4 per clip of a video model at encoding.fps (16). TensorBoard shows a clip as a strip of its frames
(its own video panel needs moviepy, a heavy dependency for a preview).
"""

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from sana2.cli import torch_dtype
from sana2.components.flow import FlowMatching
from sana2.components.sample_files import clips_for_display, for_display, write_samples
from sana2.components.sampling import eval_mode, sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.config import Encoding, Validation
from sana2.data.features import FeatureDataset
from sana2.distributed.context_parallel import ContextParallel, WholeClipForward
from sana2.distributed.parallel_dims import ParallelDims
from sana2.distributed.utils import RunOnRank0Error, reshard, run_on_rank0
from sana2.encoders.autoencoder import Autoencoder, build_autoencoder
from sana2.encoders.text_encoder import TextEncoder, build_text_encoder, resolve_instruction
from sana2.log import logger


class ValidationError(ValueError):
    """A validation setting the run cannot use, named by its config key (the caller adds the config file)."""


class Validator:
    def __init__(
        self,
        validation: Validation,
        encoding: Encoding,
        model,
        ema,
        metrics_logger,
        *,
        flow_shift: float,
        samples_folder: Path,
        val_dir: Path | None,
        latent_shape: tuple[int, ...],
        text_encoder: TextEncoder | None = None,
        dims: ParallelDims,
        local_batch_size: int,
        cp: ContextParallel | None = None,
    ):
        """From the [validation] section, with [encoding]'s text encoder and VAE: samples `latent_shape` latents
        (at training.flow_shift `flow_shift`; clips written under `samples_folder`); the held-out loss reads
        `val_dir` (None: no loss). The prompts are encoded with `text_encoder` on every rank (a sharded one is
        a collective), else on rank 0 with the configured one, to the model's caption length. The held-out
        batches (`local_batch_size` each) are split over the data ranks of `dims`; with `cp`, each cp group
        splits its clips' frames (sampling gathers them). Settings that do not fit raise ValidationError."""
        device = model.null_caption().device  # the compute device (parameters may be offloaded)
        rank, world_size = dims.data_rank, dims.dp_size
        self.settings = validation
        self.flow_shift = flow_shift
        self.model, self.ema, self.metrics, self.device = model, ema, metrics_logger, device
        self.cp = cp
        prompts = [p for p in self.settings.prompts for _ in range(self.settings.images_per_prompt)]
        if text_encoder is not None:
            (embeds, mask), (_, null_mask) = text_encoder.encode(prompts), text_encoder.null_caption()
        else:
            embeds, mask, _, null_mask = encode_on_rank0(encoding, model.caption_shape[0], prompts)
        caption_shape = model.caption_shape
        if tuple(embeds.shape[1:]) != caption_shape:
            raise ValidationError(
                f"encoding.text_encoder = {encoding.text_encoder!r} gives caption embeddings of "
                f"{tuple(embeds.shape[1:])} (tokens, width); the model takes {caption_shape}: use "
                f"the encoder the data was made with"
            )
        self.caption_embeds = embeds[:, None].to(device)
        self.caption_mask = mask.to(device)
        self.null_mask = null_mask.to(device)  # the model's null caption is the empty prompt's embedding
        self.noise = sampling_noise(self.settings.seed, len(prompts), tuple(latent_shape)).to(device)
        self.loss_batches = self._loss_batches(val_dir, rank, world_size, local_batch_size)
        self.rank = dims.rank  # rank 0 logs the images
        self.samples_folder = Path(samples_folder)
        self.fps = encoding.fps
        # only rank 0 logs images, so only rank 0 holds and runs the VAE
        self.vae = load_vae_on_rank0(*validation.vae_setting(encoding), device)

    def _loss_batches(self, val_dir, rank, world_size, batch_size) -> list[dict]:
        """This rank's held-out batches: of the first num_loss_samples samples, bucket by bucket, every
        world_size-th, a multiple of world_size per bucket, so that every rank runs the same forwards."""
        if val_dir is None or self.settings.num_loss_samples == 0:
            return []
        dataset = FeatureDataset(val_dir)
        captions = (dataset.caption_length, dataset.caption_dim)
        if captions != tuple(self.caption_embeds.shape[2:]):
            raise ValidationError(
                f"data.val_path {val_dir} holds captions of {captions} (tokens, width); "
                f"training uses {tuple(self.caption_embeds.shape[2:])}"
            )
        for latent_shape in dataset.latent_shapes:
            try:
                self.model.check_fits(latent_shape, captions)
            except ValueError as exc:
                raise ValidationError(f"data.val_path {val_dir}: {exc}") from None
        first = dataset.bucket_ids[: min(self.settings.num_loss_samples, len(dataset))]
        batches = []
        for bucket in torch.unique(first).tolist():
            members = torch.nonzero(first == bucket).flatten().tolist()
            mine = members[: len(members) // world_size * world_size][rank::world_size]
            for start in range(0, len(mine), batch_size):
                batch = dataset.get_batch(mine[start : start + batch_size])
                batch["indices"] = torch.tensor(mine[start : start + batch_size])
                batches.append({k: v.to(self.device) for k, v in batch.items()})
        return batches

    def run(self, step: int) -> dict[str, float]:
        use_ema = self.settings.use_ema and self.ema is not None
        with self.ema.weights_swapped_in() if use_ema else nullcontext():
            images = flow_sample(
                self.model if self.cp is None else WholeClipForward(self.model, self.cp),
                self.noise,
                self.caption_embeds,
                self.caption_mask,
                self.null_mask,
                self.settings.sampling_steps,
                self.settings.cfg_scale,
                build_scheduler(scheduler_config(self.settings.scheduler, self.flow_shift)),
            )
            loss = (
                validation_loss(
                    self.model, self.loss_batches, tuple(self.settings.loss_sigmas), self.settings.seed, self.cp
                )
                if self.loss_batches
                else None
            )
            if use_ema:  # blocks kept unsharded after the no-grad forward would hold EMA weights
                reshard(self.model)
        self.last_images = images
        if self.rank != 0:
            return {"validation/loss": loss} if loss is not None else {}
        if self.vae is not None:
            images = self.vae.decode(images)  # RGB in [-1, 1]
        per_prompt, folder = self.settings.images_per_prompt, self.samples_folder / f"step-{step}"
        try:
            write_samples(images, self.settings.prompts, per_prompt, folder, self.fps)
        except OSError as exc:  # a full disk: the run goes on (its checkpoint says what it needs)
            logger.warning(f"step {step}: validation samples not written to {folder}: {exc.strerror or exc}")
        shown = frame_strips(clips_for_display(images)) if images.dim() == 5 else for_display(images)
        self.metrics.images("validation/images", shown, step, nrow=per_prompt)
        results = {"validation/loss": loss} if loss is not None else {}
        if results:
            self.metrics.scalars(step, results)
            logger.info(f"step {step}: validation loss {loss:.4f}")
        return results


def frame_strips(videos: torch.Tensor, frames: int = 8) -> torch.Tensor:
    """[N, 3, H, k * W]: up to `frames` evenly spaced frames of each clip [N, 3, T, H, W], side by side."""
    count = videos.shape[2]
    picked = torch.linspace(0, count - 1, min(frames, count)).round().long()
    chosen = videos.float().clamp(-1, 1).cpu()[:, :, picked]  # [N, 3, k, H, W]
    return torch.cat(chosen.unbind(2), dim=-1)


def encode_on_rank0(encoding: Encoding, caption_length: int, prompts: list[str]) -> tuple[torch.Tensor, ...]:
    """Rank 0 loads [encoding]'s text encoder (a real one is large) and sends all ranks the prompts' embeddings
    (`caption_length` tokens) and mask, and the null caption's (the empty prompt's, without instruction:
    TextEncoder.null_caption). An encoder that cannot be loaded raises ValidationError on every rank."""
    instruction = resolve_instruction(encoding.text_encoder, encoding.instruction)

    def encode():
        dtype = torch_dtype(encoding.dtype)
        encoder = build_text_encoder(encoding.text_encoder, caption_length, dtype=dtype, instruction=instruction)
        return (*encoder.encode(prompts), *encoder.null_caption())

    try:
        return run_on_rank0(
            encode,
            lambda exc: f"encoding.text_encoder = {encoding.text_encoder!r} cannot be loaded: {exc}",
        )
    except RunOnRank0Error as exc:
        raise ValidationError(str(exc)) from None


def load_vae_on_rank0(path: str, key: str, device: torch.device) -> Autoencoder | None:
    """The VAE on rank 0, None elsewhere (and without a VAE); a failure to load raises ValidationError, naming
    the config `key` that set `path`, on every rank."""
    if not path:
        return None
    loaded = []
    try:  # the model stays on rank 0; the other ranks learn only whether loading worked
        run_on_rank0(
            lambda: loaded.append(build_autoencoder(path, device=device)),
            lambda exc: f"{key} = {path!r}: the validation VAE cannot be loaded: {exc}",
        )
    except RunOnRank0Error as exc:
        raise ValidationError(str(exc)) from None
    return loaded[0] if loaded else None


# -- the held-out loss ---------------------------------------------------------------------------


def _check_same_batch_count(num_batches: int, device: torch.device) -> None:
    """Fail on every rank, instead of hanging in FSDP's all-gathers, if the counts differ."""
    if not dist.is_initialized():
        return
    bounds = torch.tensor([num_batches, -num_batches], dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    most, fewest = int(bounds[0]), -int(bounds[1])
    if most != fewest:
        raise ValueError(
            f"validation_loss needs the same number of batches on every rank (between {fewest} and {most})"
        )


@torch.no_grad()
def validation_loss(
    model: nn.Module, batches: list[dict], sigmas: tuple[float, ...], seed: int, cp: ContextParallel | None = None
) -> float:
    """Mean training loss (FlowMatching's) over all ranks' held-out samples, each at every sigma in
    `sigmas`, without caption dropout.

    Each batch holds latents [b, C, H, W], caption_embeds [b, 1, L, C_cap], caption_mask [b, L]
    and indices [b] (global sample indices, which seed the noise). Sums and counts are
    all-reduced, so every rank returns the same global mean, and a sample contributes the same
    term however the samples are split across ranks. Every rank must pass the same number of
    batches (FSDP's forwards are collectives). With `cp`, the ranks of a cp group hold the same batches
    and split their frames; each counts the whole samples, which leaves the mean as it is.
    """
    flow = FlowMatching(seed)
    # the compute device: parameters may live on the CPU (FSDP CPU offload), buffers never do
    device = model.null_caption().device
    _check_same_batch_count(len(batches), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    with eval_mode(model):
        for batch in batches:
            latents = batch["latents"]
            for key, sigma in enumerate(sigmas):
                draw = flow.draw_at(sigma, key, batch["indices"], tuple(latents.shape[1:])).to(latents.device)
                loss_sum += flow.loss(model, batch, draw, cp).double().sum()
                count += latents.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(count), dtype=torch.float64, device=device)])
    if dist.is_initialized():
        dist.all_reduce(totals)
    if totals[1] == 0:
        raise ValueError("validation_loss got no held-out samples on any rank")
    return (totals[0] / totals[1]).item()
