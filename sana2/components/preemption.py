"""Stop requests: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) ends the run at a safe point.

A handler only records the signal on the rank that received it; the trainer adds the flag to the
step's all-reduce, so every rank learns of it at the same step, saves, and exits cleanly.
"""

import signal


class StopSignal:
    def __init__(self):
        self.received = False  # this rank's own; never cleared

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._record)

    def _record(self, signum, frame) -> None:
        self.received = True
