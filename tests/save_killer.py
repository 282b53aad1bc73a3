"""`sana2.train` for torchrun, except that one rank SIGKILLs itself right after writing its shard of
one checkpoint: the crash a checkpoint save must survive. Used by tests/test_checkpoint.py.

    torchrun ... tests/save_killer.py <sana2.train arguments>
    KILL_RANK  the rank that dies
    KILL_STEP  the checkpoint step whose save it dies in (after its data file and checksums are written)
"""

import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from sana2.components.checkpoint import ChecksummingWriter
from sana2.train import main

write_shard = ChecksummingWriter.write_data


def write_shard_then_die(self, plan, planner):
    written = write_shard(self, plan, planner)
    victim, step = int(os.environ["KILL_RANK"]), os.environ["KILL_STEP"]
    if dist.get_rank() == victim and Path(self.path).name == f"step-{step}.partial":
        os.kill(os.getpid(), signal.SIGKILL)
    return written


if __name__ == "__main__":
    ChecksummingWriter.write_data = write_shard_then_die
    sys.exit(main())
