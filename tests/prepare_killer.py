"""`sana2-prepare`, except that the process SIGKILLs itself right after writing its KILL_AFTER-th shard: the crash
a resumed run must recover from. Used by tests/test_prepare.py.

    python tests/prepare_killer.py <sana2-prepare arguments>
"""

import os
import signal
import sys

from sana2.prepare import parse_args, prepare

if __name__ == "__main__":
    written = []

    def die_after_enough(shard_index: int) -> None:
        written.append(shard_index)
        if len(written) == int(os.environ["KILL_AFTER"]):
            os.kill(os.getpid(), signal.SIGKILL)

    prepare(parse_args(sys.argv[1:]), on_shard_written=die_after_enough)
    sys.exit(0)
