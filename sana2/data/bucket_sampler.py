"""Global batches drawn from one aspect-ratio bucket each: deterministic, resumable, world-size independent.

A model batch needs one latent shape, so every global batch (local batch x data-parallel ranks x
gradient-accumulation steps = G samples) comes from a single bucket. The order of epoch e is a
function of (seed, e) and of which samples are in which bucket, nothing else:

  1. each bucket's samples are shuffled, and cut into consecutive batches of G (the last < G are left
     out of this epoch; another epoch shuffles them in);
  2. the batches of all buckets are shuffled together, so that buckets alternate in proportion to
     their sizes.

The sampler hands out whole global batches; `rank_micro_batches` cuts one into each rank's micro-batches
exactly as the uniform loader does (micro-batch m of rank r starts at m * local * ranks + r * local). Its
state is (epoch, step in epoch) over global batches, so a run resumed at another world size with the same
G sees the same samples in the same steps. The per-epoch generator is the uniform loader's, seeded by
(seed, epoch).
"""

import torch

from sana2.seeding import seeded_generator


class BucketBatchSampler:
    """Hands out global batches of `global_batch_size` sample indices, each from one bucket."""

    def __init__(self, bucket_ids, global_batch_size: int, seed: int):
        self.bucket_ids = torch.as_tensor(bucket_ids, dtype=torch.int64)
        if self.bucket_ids.dim() != 1 or len(self.bucket_ids) == 0:
            raise ValueError("bucket_ids must list one bucket per sample")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.members = [torch.nonzero(self.bucket_ids == b).flatten() for b in torch.unique(self.bucket_ids).tolist()]
        self.steps_per_epoch = sum(len(m) // global_batch_size for m in self.members)
        if self.steps_per_epoch == 0:
            sizes = {int(self.bucket_ids[m[0]]): len(m) for m in self.members}
            raise ValueError(
                f"no bucket holds a full global batch of {global_batch_size} samples (samples per bucket: {sizes}); "
                "use a smaller batch, fewer buckets or more data"
            )
        self.epoch = 0
        self.step_in_epoch = 0
        self._cached: tuple[int, torch.Tensor] | None = None

    def epoch_batches(self, epoch: int) -> torch.Tensor:
        """[steps_per_epoch, G] sample indices of every global batch of `epoch`, in order."""
        if self._cached is None or self._cached[0] != epoch:
            generator = seeded_generator("loader", self.seed, epoch)
            batches = []
            for members in self.members:
                shuffled = members[torch.randperm(len(members), generator=generator)]
                full = len(members) // self.global_batch_size * self.global_batch_size
                batches.append(shuffled[:full].view(-1, self.global_batch_size))
            batches = torch.cat(batches)
            self._cached = (epoch, batches[torch.randperm(len(batches), generator=generator)])
        return self._cached[1]

    def peek(self) -> torch.Tensor:
        """The next global batch's sample indices [G] (does not advance)."""
        return self.epoch_batches(self.epoch)[self.step_in_epoch].clone()

    def next_batch(self) -> torch.Tensor:
        """The next global batch's sample indices [G], then advance (to the next epoch after the last)."""
        batch = self.peek()
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_batch_size": self.global_batch_size,
            "num_samples": len(self.bucket_ids),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["global_batch_size"] != self.global_batch_size:
            raise ValueError(
                f"bucket sampler state was saved with global batch size {state['global_batch_size']}, this run "
                f"uses {self.global_batch_size}; resuming needs the same global batch size"
            )
        if state["num_samples"] != len(self.bucket_ids):
            raise ValueError(
                f"bucket sampler state was saved for {state['num_samples']} samples, this dataset has "
                f"{len(self.bucket_ids)}; resuming needs the same dataset"
            )
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise ValueError(
                f"bucket sampler state epoch={epoch} step_in_epoch={step} does not fit {self.steps_per_epoch} "
                "steps per epoch"
            )
        self.epoch, self.step_in_epoch = epoch, step


def rank_micro_batches(
    global_batch: torch.Tensor, local_batch_size: int, dp_rank: int, dp_world_size: int
) -> list[torch.Tensor]:
    """This rank's micro-batches of one global batch, one per gradient-accumulation step."""
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
