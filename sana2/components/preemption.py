"""Stop requests: SIGTERM (a scheduler's preemption) or SIGINT (Ctrl-C) end the run at a safe point,
with a checkpoint that lands within the grace period before the scheduler's kill.

A signal handler only notes the signal and when it came, on the rank that received it (the sana2
launcher forwards the launcher's signals to every worker). The trainer calls `StopAgreement.poll`
at every safe point, before each micro-batch. At an agreement point one all-reduce of a few floats
tells every rank the same things: whether any rank was asked to stop and how long ago, how long the
step in progress needs to finish, how long a save takes, how long a safe point lasts. It runs on CPU
tensors (gloo; "cpu:gloo" beside NCCL on GPUs), so it never waits for a GPU's stream. Agreement
points come about every `interval` seconds (a twentieth of the grace period, at most 1 s): from the
agreed pace (the slowest rank's seconds per safe point, from its last step) every rank counts the
same number of safe points to the next one; until a step has been timed, and once a stop is under
way, every safe point is one. The first safe point after a validation or a save is one too, so a
signal that came during them is seen at once. All ranks then take the same decision:
- go on (no stop requested, or the step in progress can finish and still be saved in time);
- stop here: before a step's first micro-batch, the last completed step is saved; later in a
  step ("drop"), the partial step is dropped (its data and random state put back) and the last
  completed step is saved.
A step may finish when its estimated remaining time plus the save's fits in the grace period,
less a margin for the processes to exit (10 % of it, at most 10 s). The save's time is the longest
save of this run; before the first, half the grace period is kept for it.

A signal is seen at most one interval (or one safe point, when a safe point lasts longer) after it
came; the decision counts that time against the grace period like any other.

If the save may not land in time, rank 0 says so before the kill: when the stop is decided, and
again shortly before the grace period ends if the save is still running.
"""

import signal
import threading
import time

import torch
import torch.distributed as dist

from sana2.log import logger

GO_ON, STOP, DROP = "go on", "stop", "drop"


class StopSignal:
    """Notes SIGTERM and SIGINT; a second SIGINT interrupts at once (Ctrl-C twice, without the launcher)."""

    def __init__(self):
        self.signum = 0  # the first signal received by this rank, 0 if none; never cleared
        self.received_at = 0.0  # its time.monotonic()
        self._previous: dict = {}

    @property
    def received(self) -> bool:
        return self.signum != 0

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._record)

    def uninstall(self) -> None:
        """Put back the handlers install() replaced."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.received:
            self.signum, self.received_at = signum, time.monotonic()


def agreed_max(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks (this process's own without a process group): the one collective
    of a stop agreement, every rank calling it at the same point. A CPU tensor (gloo), so it never waits for
    a GPU's stream; sana2-prepare's agreement (sana2/prepare.py) uses it too."""
    agreed = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed.tolist()


class StopAgreement:
    """The stop decision every rank takes alike at a safe point (see the module docstring)."""

    def __init__(self, stop_signal: StopSignal, grace_period: float, rank: int):
        self.signal, self.grace_period, self.rank = stop_signal, grace_period, rank
        self.margin = min(10.0, 0.1 * grace_period)  # for the processes to exit after the save
        self.interval = min(1.0, grace_period / 20)  # seconds between agreement points
        self.longest_save: float | None = None
        self._skip = 0  # safe points before the next agreement point (the same on every rank)
        self.stopping = False  # agreed: a stop is under way (every rank knows the same)
        self._decided_at = 0.0  # time.monotonic() of the decision, less the agreed age of the signal
        self._signal_name = ""
        self._watchdog: threading.Timer | None = None

    def poll(self, finish_seconds: float, step: int, pace: float = 0.0) -> str:
        """GO_ON, STOP or DROP, the same on every rank (collective at agreement points).

        `finish_seconds`: this rank's estimate of the time the step in progress (`step`) still
        needs; 0 before its first micro-batch. `pace`: this rank's seconds per safe point, from its
        last completed step (0 while none is).
        """
        if self._skip > 0 and not self.stopping:
            self._skip -= 1
            return GO_ON
        mine = self.signal
        age = time.monotonic() - mine.received_at if mine.received else 0.0
        save = self.longest_save if self.longest_save is not None else self.grace_period / 2
        signum, age, finish, save, pace = agreed_max([float(mine.signum), age, finish_seconds, save, pace])
        self._skip = max(int(self.interval / pace), 1) - 1 if pace > 0 else 0
        if not signum:
            return GO_ON
        first = not self.stopping
        if first:
            self.stopping, self._decided_at = True, time.monotonic() - age
            self._signal_name = signal.Signals(int(signum)).name
        budget = self.grace_period - self.margin - age
        if finish and finish + save <= budget:
            if first and self.rank == 0:
                logger.info(
                    f"{self._signal_name} received {age:.1f} s ago: finishing step {step} (about {finish:.1f} s), "
                    f"then saving it (about {save:.1f} s) within the {self.grace_period:g} s grace period"
                )
            return GO_ON
        if self.rank == 0:
            if finish:
                logger.warning(
                    f"{self._signal_name} received {age:.1f} s ago: step {step} cannot finish and be saved "
                    f"within the {self.grace_period:g} s grace period (about {finish:.1f} s + {save:.1f} s "
                    f"needed, {budget:.1f} s left): dropping it and saving step {step - 1}"
                )
            else:
                logger.info(f"{self._signal_name} received {age:.1f} s ago: saving step {step - 1} and stopping")
        return DROP if finish else STOP

    def agree_at_next_safe_point(self) -> None:
        """Make the next safe point an agreement point (every rank calls it at the same point: after a
        validation or a save, whose time no pace foresees)."""
        self._skip = 0

    def seconds_left(self) -> float:
        """Of the grace period, less the exit margin, since the signal (meaningful once stopping)."""
        return self.grace_period - self.margin - (time.monotonic() - self._decided_at)

    def before_save(self, step: int, latest_complete: str) -> None:
        """Rank 0, stopping: warn now if the save may not land in time, and arm a warning for just
        before the kill. `latest_complete`: what a kill would leave, for the message."""
        left = self.seconds_left()
        save = self.longest_save if self.longest_save is not None else self.grace_period / 2
        if self.longest_save is not None and save > left:
            logger.warning(
                f"checkpoint step-{step} may not land within the grace period: saving took up to {save:.1f} s in "
                f"this run and {left:.1f} s are left; if the kill comes first, {latest_complete} stays intact"
            )
        self._watchdog = threading.Timer(max(left, 0.0), self._still_saving, args=(step, latest_complete))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _still_saving(self, step: int, latest_complete: str) -> None:
        logger.warning(
            f"the {self.grace_period:g} s grace period ends in {self.margin:g} s and checkpoint step-{step} is "
            f"still being written: the kill will interrupt it; {latest_complete} stays intact"
        )

    def after_save(self, seconds: float | None) -> None:
        """A save ended; `seconds`: how long it took, None if unknown (an async save's blocking time)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if seconds is not None:
            self.longest_save = max(seconds, self.longest_save or 0.0)
