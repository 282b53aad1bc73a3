"""The stop decision at a safe point, and the warnings when a save may not land within the grace period.

One process without a process group: the decision's all-reduce is then the rank's own values.
Whole runs stopped through the launcher are in tests/test_launch.py."""

import os
import signal
import time

import pytest

from sana2.components.preemption import DROP, GO_ON, STOP, StopAgreement, StopSignal


def _signalled(seconds_ago: float = 0.0, signum: int = signal.SIGTERM) -> StopSignal:
    stop = StopSignal()
    stop.signum, stop.received_at = signum, time.monotonic() - seconds_ago
    return stop


def test_no_signal_goes_on():
    assert StopAgreement(StopSignal(), 60, rank=0).poll(finish_seconds=5, step=3) == GO_ON


def test_a_signal_before_a_step_starts_stops_and_saves_the_last_step(sana2_log):
    agreement = StopAgreement(_signalled(2.0), 60, rank=0)
    assert agreement.poll(0.0, step=8) == STOP and agreement.stopping
    assert "SIGTERM received 2.0 s ago: saving step 7 and stopping" in sana2_log.text


def test_a_step_finishes_only_if_it_and_the_save_fit_in_the_grace_period(sana2_log):
    # grace 60 s: 6 s are kept for the exit; before any save, 30 s are kept for the save
    agreement = StopAgreement(_signalled(4.0), 60, rank=0)
    assert agreement.poll(finish_seconds=19.0, step=5) == GO_ON  # 4 + 19 + 30 <= 54
    assert "finishing step 5 (about 19.0 s), then saving it (about 30.0 s)" in sana2_log.text
    assert agreement.poll(finish_seconds=21.0, step=5) == DROP  # 4 + 21 + 30 > 54
    assert "step 5 cannot finish and be saved within the 60 s grace period" in sana2_log.text
    assert "dropping it and saving step 4" in sana2_log.text
    measured = StopAgreement(_signalled(4.0), 60, rank=0)
    measured.after_save(2.0)  # a save of this run took 2 s: a longer step may finish
    assert measured.poll(finish_seconds=45.0, step=5) == GO_ON


def test_a_save_that_may_not_land_is_announced_and_again_just_before_the_kill(sana2_log):
    agreement = StopAgreement(_signalled(0.0), grace_period=1.0, rank=0)  # 0.1 s kept for the exit
    agreement.after_save(5.0)
    assert agreement.poll(0.0, step=3) == STOP
    agreement.before_save(2, "checkpoint /x/step-1")
    assert "checkpoint step-2 may not land within the grace period: saving took up to 5.0 s" in sana2_log.text
    assert "if the kill comes first, checkpoint /x/step-1 stays intact" in sana2_log.text
    time.sleep(1.2)
    assert "the 1 s grace period ends in 0.1 s and checkpoint step-2 is still being written" in sana2_log.text
    agreement.after_save(None)


def test_a_save_in_time_cancels_the_warning(sana2_log):
    agreement = StopAgreement(_signalled(0.0), grace_period=1.0, rank=0)
    assert agreement.poll(0.0, step=3) == STOP
    agreement.before_save(2, "no checkpoint")
    agreement.after_save(0.1)
    time.sleep(1.2)
    assert "still being written" not in sana2_log.text


def test_the_stop_signal_notes_the_first_signal_and_a_second_ctrl_c_interrupts():
    stop = StopSignal()
    previous = signal.getsignal(signal.SIGTERM)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # repeats are ignored
        interrupt = StopSignal()
        interrupt.install()
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupt.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        interrupt.uninstall()
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous
