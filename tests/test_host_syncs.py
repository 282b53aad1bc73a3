"""A training step waits for the device once: the loss, the sample count, the gradient norm and the
per-sample losses of the metrics are read to the host together, at the end of the step. On a GPU every
other read (`.item()`, a blocking copy) would stall the host until the stream drains, and the next
step's work would not be queued meanwhile.

On CUDA the count is torch's own (`torch.cuda.set_sync_debug_mode("warn")` warns at each synchronising
operation, wherever it is). On CPU, where nothing tells a host tensor from a device one, it counts the
reads of tensor values into Python (`.item()`, `.tolist()`, `float()`, ...) that sana2's code makes,
less those of tensors that stay on the host whatever the device: the data pipeline's (sana2/data), the
cross-rank reductions of the metrics and the stop agreement (CPU tensors, gloo) and the sample ids the
noise is drawn for. benchmarks/gpu_check.sh runs this file on the GPU.
"""

import signal
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_utils import tiny_config

import sana2
from sana2.components.preemption import StopAgreement, StopSignal

SANA2 = str(Path(sana2.__file__).parent)
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__bool__")
# (file, function) of the host-side reads (see the module docstring); and every file of sana2/data
HOST_SIDE = {
    ("preemption.py", "agreed_max"),
    ("stats.py", "all_reduce_stats"),
    ("stats.py", "reduce"),
    ("flow.py", "draw"),
}
HOST_SIDE_FOLDER = str(Path(SANA2) / "data")


@contextmanager
def device_waits(device: torch.device):
    """A list that receives one entry per wait for `device` inside the block."""
    waits: list[str] = []
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield waits
            finally:
                torch.cuda.set_sync_debug_mode("default")
                waits += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        return
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, original):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code
            where = (Path(caller.co_filename).name, caller.co_name)
            host_side = where in HOST_SIDE or caller.co_filename.startswith(HOST_SIDE_FOLDER)
            if caller.co_filename.startswith(SANA2) and not host_side:
                waits.append(f"{where[0]}:{where[1]} .{name}()")
            return original(tensor, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(name, original))
    try:
        yield waits
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def test_a_training_step_waits_for_the_device_once(tmp_path):
    from sana2.train import Trainer

    # two micro-batches, an EMA, gradient clipping, a metrics log every step: everything a step runs
    trainer = Trainer(
        tiny_config(
            tmp_path,
            "--training.local_batch_size=4",
            "--training.gradient_accumulation_steps=2",
            "--training.ema_decay=0.9",
            "--training.max_norm=0.5",
            "--metrics.log_freq=1",
        )
    )
    try:
        for step in range(4):
            with device_waits(trainer.device) as waits:
                trainer.metrics.begin_step()
                result = trainer.train_step()
                trainer.metrics.end_step(trainer.step, result, trainer.train_state.skipped_steps)
            if step:  # the first step also sets things up (optimizer state, caches)
                assert len(waits) == 1, sorted(set(waits))
                if trainer.device.type == "cpu":
                    assert waits == ["train.py:_read_step .tolist()"]
        assert result.sample_losses.device.type == "cpu" and result.sample_losses.numel() == 8
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()


@pytest.fixture
def agreement_calls(monkeypatch):
    """The stop agreement's all-reduces, recorded instead of run (an agreement of one rank)."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None: calls.append(tensor.device.type))
    return calls


def test_ranks_agree_about_once_an_interval_at_the_agreed_pace(agreement_calls):
    agreement = StopAgreement(StopSignal(), grace_period=60, rank=0)  # one agreement a second
    assert agreement.interval == 1.0
    for _ in range(6):  # no step timed yet: every safe point
        agreement.poll(0.0, step=1)
    assert len(agreement_calls) == 6
    for _ in range(30):  # 4 safe points a second: every 4th
        agreement.poll(0.5, step=2, pace=0.25)
    assert len(agreement_calls) == 6 + 8  # the 1st, 5th, ..., 29th
    assert set(agreement_calls) == {"cpu"}  # gloo on CPU tensors: never the GPU's stream
    agreement.poll(0.5, step=2, pace=0.25)  # the 31st: between agreements
    agreement.agree_at_next_safe_point()  # after a validation or a save
    agreement.poll(0.5, step=3, pace=2.0)
    assert len(agreement_calls) == 6 + 8 + 1
    for _ in range(3):  # slower than the interval: every safe point
        agreement.poll(0.5, step=3, pace=2.0)
    assert len(agreement_calls) == 6 + 8 + 1 + 3


def test_once_a_stop_is_under_way_every_safe_point_is_an_agreement(agreement_calls):
    stop = StopSignal()
    agreement = StopAgreement(stop, grace_period=60, rank=0)
    agreement.poll(0.5, step=1, pace=0.1)  # the next agreement is 10 safe points away
    stop.signum, stop.received_at = signal.SIGTERM, time.monotonic()
    polls = 0
    while not agreement.stopping:
        agreement.poll(0.5, step=1, pace=0.1)
        polls += 1
    assert polls == 10  # seen at the next agreement point, one interval later
    before = len(agreement_calls)
    for _ in range(3):  # finishing the step: each safe point re-checks the time left
        agreement.poll(0.5, step=1, pace=0.1)
    assert len(agreement_calls) == before + 3
