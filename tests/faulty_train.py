"""`sana2.train` with one fault injected, for the launcher tests (tests/test_launch.py).

python -m sana2.launch ... tests/faulty_train.py <sana2.train arguments>
SANA2_FAULT   which fault:
  rank1_user_error   rank 1 alone meets a data error when training starts (its output is not shown)
  internal_error     rank 0 meets a bug when training starts
  save_disk_full     the disk fills while rank 1 writes its shard of the final checkpoint
  digits_disk_full   the disk fills while the digits data is built
  nonfinite_step_2   rank 1's batch of step 2 holds a NaN (the step is skipped)
  slow_save          every checkpoint save takes SANA2_SAVE_SECONDS longer
"""

import errno
import os
import sys
import time

import torch.distributed as dist
from safetensors import SafetensorError

from sana2.components import checkpoint
from sana2.data import writer
from sana2.data.features import DataFormatError
from sana2.train import Trainer, worker_main

FAULT = os.environ["SANA2_FAULT"]


def inject() -> None:
    real_train, real_write, real_save, real_next_step = (
        Trainer.train,
        checkpoint.ChecksummingWriter.write_data,
        writer.save_file,
        Trainer.train_step,
    )

    def train(self):
        if FAULT == "rank1_user_error" and self.rank == 1:
            raise DataFormatError("shard_00003.safetensors: caption_mask holds 7, expected 0 or 1")
        if FAULT == "internal_error" and self.rank == 0:
            raise RuntimeError("an injected bug")
        return real_train(self)

    def write_data(self, plan, planner):
        if FAULT == "save_disk_full" and dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.path, "__1_0.distcp"))
        if FAULT == "slow_save":
            time.sleep(float(os.environ["SANA2_SAVE_SECONDS"]))
        return real_write(self, plan, planner)

    def save_file(tensors, path, *args, **kwargs):
        if FAULT == "digits_disk_full":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save(tensors, path, *args, **kwargs)

    def train_step(self):
        if FAULT == "nonfinite_step_2" and self.step + 1 == 2 and self.rank == 1:
            real_batches = self.loader.next_step

            def poisoned():
                self.loader.next_step = real_batches
                batches = real_batches()
                batches[0]["latents"][0].fill_(float("nan"))
                return batches

            self.loader.next_step = poisoned
        return real_next_step(self)

    Trainer.train, Trainer.train_step = train, train_step
    checkpoint.ChecksummingWriter.write_data = write_data
    writer.save_file = save_file


if __name__ == "__main__":
    inject()
    sys.exit(worker_main())
