"""How legible are the digits a checkpoint draws? A reader trained on the real digits tells.

    python benchmarks/bench_digit_legibility.py outputs/debug/checkpoint/step-600 [--images 16] [--cfg 3]

For each digit d it samples `--images` images of "the number d" the way `python -m sana2.sample`
does (same loader, sampler, seeds and the run's [validation] settings), with the EMA weights and with
the raw ones, and counts how many a multinomial logistic regression on the 64 pixels, fitted to the
1,797 real 8x8 digits, reads as d. The reader's own accuracy on real digits it was not fitted to
is printed first, as the yardstick.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from sana2.components.sampling import sampling_noise
from sana2.components.schedulers import build_scheduler, flow_sample, scheduler_config
from sana2.components.validator import encode_on_rank0
from sana2.data.digits import load_digits
from sana2.sample import build_parser, latent_shape, load_model, run_config


def fit_reader(pixels: torch.Tensor, labels: torch.Tensor) -> torch.nn.Linear:
    """Multinomial logistic regression on flattened pixels in [-1, 1], L2-regularised, fitted with L-BFGS."""
    torch.manual_seed(0)
    reader = torch.nn.Linear(pixels[0].numel(), 10)
    optimizer = torch.optim.LBFGS(reader.parameters(), max_iter=300, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(reader(pixels.flatten(1)), labels) + 1e-3 * reader.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return reader.requires_grad_(False)


def read(reader: torch.nn.Linear, images: torch.Tensor) -> torch.Tensor:
    return reader(images.clamp(-1, 1).flatten(1)).argmax(1)


def reader_accuracy(pixels: torch.Tensor, labels: torch.Tensor, held_out: int = 297) -> float:
    """Accuracy on the last `held_out` real digits of a reader fitted to the others."""
    reader = fit_reader(pixels[:-held_out], labels[:-held_out])
    return (read(reader, pixels[-held_out:]) == labels[-held_out:]).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--images", type=int, default=16, help="images per digit")
    parser.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the run's)")
    args = parser.parse_args()

    pixels, labels = load_digits()
    accuracy = reader_accuracy(pixels, labels)
    print(f"reader: logistic regression on 64 pixels, {accuracy:.1%} right on 297 held-out real digits")
    reader = fit_reader(pixels, labels)

    sample_args = build_parser().parse_args([str(args.checkpoint), "--prompt", "-", "--out", "-"])
    config = run_config(sample_args, args.checkpoint)
    settings = config.validation
    cfg = settings.cfg_scale if args.cfg is None else args.cfg
    prompts = [f"the number {digit}" for digit in range(10)]
    repeated = [prompt for prompt in prompts for _ in range(args.images)]
    embeds, mask, _, null_mask = encode_on_rank0(config.encoding, config.caption_length, repeated)
    wanted = torch.arange(10).repeat_interleave(args.images)
    print(
        f"{args.checkpoint}: {args.images} images per digit, {settings.sampling_steps} {settings.scheduler} steps, "
        f"cfg {cfg}, seed {settings.seed}"
    )
    print("weights  " + " ".join(f"{digit:>5}" for digit in range(10)) + "    all")
    for ema in (True, False):
        model, _ = load_model(config, args.checkpoint, ema, torch.float32, torch.device("cpu"), None)
        noise = sampling_noise(settings.seed, len(wanted), latent_shape(model, sample_args, vae_factor=1))
        scheduler = build_scheduler(scheduler_config(settings.scheduler, config.training.flow_shift))
        images = flow_sample(model, noise, embeds[:, None], mask, null_mask, settings.sampling_steps, cfg, scheduler)
        right = (read(reader, images) == wanted).float().view(10, args.images).mean(1)
        print(f"{'EMA' if ema else 'raw':<8} " + " ".join(f"{v:5.0%}" for v in right) + f"  {right.mean():5.1%}")


if __name__ == "__main__":
    main()
