"""Deterministic, resumable batches of a dataset for data-parallel training, each from one bucket.

A model batch needs one latent shape, so every global batch (local batch x data-parallel ranks x
gradient-accumulation steps = G samples) comes from a single aspect-ratio bucket of the dataset. The
order of epoch e is a function of (seed, e) and of which samples are in which bucket, nothing else:

  1. each bucket's samples are shuffled and cut into consecutive global batches of G (a bucket's last
     < G samples are left out of this epoch; another epoch's shuffle brings them in);
  2. with several buckets, the batches of all buckets are shuffled together, so that buckets alternate
     in proportion to their sizes. (With one bucket the batches are already in random order: they are
     taken as they come, consecutive slices of one permutation of the dataset.)

Both shuffles draw from one generator seeded by ("loader", seed, epoch) (sana2/seeding.py). Nothing
depends on the number of ranks: each rank takes its slices of the global batch, and a run resumed at
another data-parallel size with the same G sees the same samples in the same steps.
"""

import torch

from sana2.seeding import seeded_generator


def epoch_batches(bucket_ids: torch.Tensor, global_batch_size: int, seed: int, epoch: int) -> torch.Tensor:
    """[steps, G] sample indices of every global batch of `epoch`, in order (steps may be 0)."""
    generator = seeded_generator("loader", seed, epoch)
    batches = []
    for bucket in torch.unique(bucket_ids).tolist():  # ascending bucket ids
        members = torch.nonzero(bucket_ids == bucket).flatten()
        shuffled = members[torch.randperm(len(members), generator=generator)]
        full = len(members) // global_batch_size * global_batch_size
        batches.append(shuffled[:full].view(-1, global_batch_size))
    if len(batches) == 1:
        return batches[0]
    batches = torch.cat(batches)
    return batches[torch.randperm(len(batches), generator=generator)]


def rank_micro_batches(
    global_batch: torch.Tensor, local_batch_size: int, dp_rank: int, dp_world_size: int
) -> list[torch.Tensor]:
    """This rank's micro-batches of one global batch, one per gradient-accumulation step: micro-batch m of
    rank r is the slice starting at m * local_batch_size * dp_world_size + r * local_batch_size."""
    micro_stride = local_batch_size * dp_world_size
    if local_batch_size < 1 or len(global_batch) % micro_stride:
        raise ValueError(
            f"a global batch of {len(global_batch)} does not split into micro-batches of {local_batch_size} "
            f"x {dp_world_size} ranks"
        )
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_world_size {dp_world_size}")
    starts = range(dp_rank * local_batch_size, len(global_batch), micro_stride)
    return [global_batch[start : start + local_batch_size].clone() for start in starts]


class DistributedFeatureLoader:
    """Deterministic, resumable batches for data-parallel training with gradient accumulation.

    `dataset` has a length, `bucket_ids` (one bucket per sample) and `get_batch(indices)`. Every
    optimizer step consumes one global batch of G = local_batch_size * dp_world_size * grad_accum_steps
    samples of one bucket (module docstring). The state (epoch, position) counts the global samples of
    the epoch consumed so far.
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
        self.bucket_ids = torch.as_tensor(dataset.bucket_ids, dtype=torch.int64)
        sizes = torch.bincount(self.bucket_ids)
        self.steps_per_epoch = int((sizes // self.global_batch_size).sum())
        if self.steps_per_epoch == 0:
            batch = (
                f"one global batch of {self.global_batch_size} (local {local_batch_size} x dp {dp_world_size} x "
                f"grad accumulation {grad_accum_steps})"
            )
            if int((sizes > 0).sum()) == 1:
                raise ValueError(f"dataset has {self.num_samples} samples, fewer than {batch}")
            per_bucket = {b: int(n) for b, n in enumerate(sizes.tolist()) if n}
            raise ValueError(
                f"no bucket holds {batch} (samples per bucket: {per_bucket}); use a smaller batch or more data"
            )
        self.samples_per_epoch = self.steps_per_epoch * self.global_batch_size
        self.epoch = 0
        self.position = 0  # samples of this epoch consumed by all ranks together
        self._cached_epoch: tuple[int, torch.Tensor] | None = None

    def epoch_batches(self, epoch: int) -> torch.Tensor:
        """[steps_per_epoch, G]: the global batches of `epoch`, identical on every rank and world size."""
        if self._cached_epoch is None or self._cached_epoch[0] != epoch:
            batches = epoch_batches(self.bucket_ids, self.global_batch_size, self.seed, epoch)
            self._cached_epoch = (epoch, batches)
        return self._cached_epoch[1]

    def step_indices(self) -> list[torch.Tensor]:
        """This rank's sample ids for each micro-batch of the next step (does not advance)."""
        global_batch = self.epoch_batches(self.epoch)[self.position // self.global_batch_size]
        return rank_micro_batches(global_batch, self.local_batch_size, self.dp_rank, self.dp_world_size)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's grad_accum_steps micro-batches for one optimizer step, then advance."""
        micro_batches = []
        for indices in self.step_indices():
            batch = self.dataset.get_batch(indices.tolist())
            batch["indices"] = indices
            micro_batches.append(batch)
        self.position += self.global_batch_size
        if self.position == self.samples_per_epoch:
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
        if epoch < 0 or position < 0 or position % saved_batch or position >= self.samples_per_epoch:
            raise ValueError(
                f"data loader state epoch={epoch} position={position} does not fit a dataset of "
                f"{self.num_samples} samples ({self.steps_per_epoch} steps of {saved_batch} per epoch)"
            )
        self.epoch, self.position = epoch, position
