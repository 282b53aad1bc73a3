"""Deterministic, resumable batches of a dataset for data-parallel training."""

import torch

from sana2.seeding import seeded_generator


class DistributedFeatureLoader:
    """Deterministic, resumable batches for data-parallel training with gradient accumulation.

    Every optimizer step consumes G = local_batch_size * dp_world_size * grad_accum_steps consecutive
    entries of the epoch's permutation. Micro-batch m of rank r is the slice starting at
    position + m * (local_batch_size * dp_world_size) + r * local_batch_size. The state (epoch, position)
    counts global samples, so a run resumed at another data-parallel size with the same G sees the same
    global samples in the same steps.
    """

    def __init__(
        self, dataset, local_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_world_size: int, seed: int
    ):
        if min(local_batch_size, grad_accum_steps, dp_world_size) < 1:
            raise ValueError("local_batch_size, grad_accum_steps and dp_world_size must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.global_batch_size = local_batch_size * dp_world_size * grad_accum_steps
        self.num_samples = len(dataset)
        if self.num_samples < self.global_batch_size:
            raise ValueError(
                f"dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.global_batch_size} (local {local_batch_size} x dp {dp_world_size} x "
                f"grad accumulation {grad_accum_steps})"
            )
        self.steps_per_epoch = self.num_samples // self.global_batch_size
        self.samples_per_epoch = self.steps_per_epoch * self.global_batch_size
        self.epoch = 0
        self.position = 0  # samples of this epoch consumed by all ranks together
        self._cached_permutation: tuple[int, torch.Tensor] | None = None

    def permutation(self, epoch: int) -> torch.Tensor:
        """The sample order of `epoch`, identical on every rank and at every world size."""
        if self._cached_permutation is None or self._cached_permutation[0] != epoch:
            generator = seeded_generator("loader", self.seed, epoch)
            self._cached_permutation = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._cached_permutation[1]

    def step_indices(self) -> list[torch.Tensor]:
        """This rank's sample ids for each micro-batch of the next step (does not advance)."""
        order = self.permutation(self.epoch)
        micro_stride = self.local_batch_size * self.dp_world_size
        starts = [
            self.position + m * micro_stride + self.dp_rank * self.local_batch_size
            for m in range(self.grad_accum_steps)
        ]
        return [order[start : start + self.local_batch_size].clone() for start in starts]

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches for one optimizer step, then advance."""
        micro_batches = []
        for indices in self.step_indices():
            batch = self.dataset.get_batch(indices.tolist())
            batch["indices"] = indices
            micro_batches.append(batch)
        self.position += self.global_batch_size
        if self.position + self.global_batch_size > self.num_samples:
            # too few samples left for a full step: drop them and start the next epoch
            self.epoch += 1
            self.position = 0
        return micro_batches

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved_batch = state["global_batch_size"]
        if saved_batch != self.global_batch_size:
            raise ValueError(
                f"data loader state was saved with global batch size {saved_batch}, but this run uses "
                f"{self.global_batch_size} (local {self.local_batch_size} x dp {self.dp_world_size} x grad "
                f"accumulation {self.grad_accum_steps}); resuming needs the same global batch size"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0 or position % saved_batch or position + saved_batch > self.num_samples:
            raise ValueError(
                f"data loader state epoch={epoch} position={position} does not fit a dataset of "
                f"{self.num_samples} samples with global batch size {saved_batch}"
            )
        self.epoch, self.position = epoch, position
