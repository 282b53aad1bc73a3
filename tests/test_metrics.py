"""Metrics: the processor's timing windows and logged values, TensorBoard and Weights & Biases output read
back, console line."""

import io
import json
import logging
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb_records import wandb_history, wandb_offline_records

from sana2.components import metrics as metrics_module
from sana2.components.metrics import (
    MetricLogger,
    MetricsProcessor,
    StepResult,
    TensorBoardTracker,
    build_trackers,
    format_duration,
    format_log_line,
)
from sana2.config import ConfigError, load_config
from sana2.distributed.parallel_dims import ParallelDims


def test_metric_logger_writes_scalars_text_and_image_grid(tmp_path):
    log_dir = tmp_path / "tb" / "run"
    logger = MetricLogger([TensorBoardTracker(log_dir)])
    for step in (10, 20):
        logger.scalars(step, {"loss": step / 100, "optim/lr": 1e-4})
    logger.text("config", "model: SanaMS_debug")
    images = torch.linspace(-1, 1, 5 * 4 * 6).view(5, 1, 4, 6)
    logger.images("samples", images, step=20, nrow=3)
    logger.close()

    settings = load_config(None, ["--metrics.enable_tensorboard=true"]).metrics
    other_rank = MetricLogger(build_trackers(settings, 1, tmp_path / "other_rank", "{}"))
    other_rank.scalars(10, {"loss": 1.0})
    other_rank.images("samples", images, step=20, nrow=3)
    other_rank.close()
    assert not (tmp_path / "other_rank").exists()

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == {"loss", "optim/lr"}
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("loss")] == [(10, 0.1), (20, 0.2)]
    text_events = events.Tensors("config/text_summary")
    assert text_events[0].tensor_proto.string_val[0].decode() == "model: SanaMS_debug"
    (image,) = events.Images("samples")
    # 2 rows x 3 columns of 4 x 6 images, framed by 1 pixel
    assert (image.step, image.height, image.width) == (20, 2 * 5 + 1, 3 * 7 + 1)


def test_metric_logger_without_trackers_is_a_no_op():
    logger = MetricLogger([])
    logger.scalars(1, {"loss": 1.0})
    logger.text("config", "x")
    logger.close()


def test_format_log_line():
    metrics = {
        "loss": 0.41234,
        "grad_norm": 1.234,
        "lr": 2e-4,
        "samples_per_second": 812.3,
        "memory/peak_rss_gib": 0.4213,
        "memory/rss_gib": 0.3,
    }
    line = format_log_line(40, 300, metrics, eta_seconds=83)
    assert line == "step  40/300  loss 0.4123  grad_norm 1.23  lr 2.0e-04  samples/s 812  mem 0.42GiB  eta 1m23s"
    cuda_line = format_log_line(
        7,
        9,
        {"loss": 2.0, "mfu": 0.4123, "memory/max_reserved_gib": 12.5, "memory/peak_rss_gib": 3.0},
        eta_seconds=None,
    )
    assert cuda_line == "step 7/9  loss 2.0000  mfu 41.2%  mem 12.50GiB"
    assert "loss nan" in format_log_line(1, 1, {"loss": math.nan}, None)
    assert [format_duration(s) for s in (0, 45.4, 83, 7325)] == ["0s", "45s", "1m23s", "2h02m"]


class FakeClock:
    """time.perf_counter for the metrics module, advanced by hand."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step_result(losses, sigmas, applied=True) -> StepResult:
    return StepResult(
        loss=float(sum(losses)) / len(losses),
        grad_norm=1.0,
        lr=1e-3,
        samples=8,
        tokens=8 * 64,
        sample_losses=torch.tensor(losses),
        sample_sigmas=torch.tensor(sigmas, dtype=torch.float64),
        applied=applied,
    )


def test_metrics_processor_logs_each_windows_timing_throughput_mfu_and_losses(tmp_path, monkeypatch, caplog):
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=clock))
    config = load_config(
        None,
        [
            f"--job.dump_folder={tmp_path}",
            "--metrics.log_freq=2",
            "--metrics.peak_flops=1e9",
            "--metrics.enable_tensorboard=false",
            "--training.steps=5",
        ],
    )
    processor = MetricsProcessor(
        config.metrics,
        ParallelDims(1, 1),
        torch.device("cpu"),
        1000,
        total_steps=config.training.steps,
        dump_folder=tmp_path,
        config_text=config.to_json(),
    )
    logged = {}
    processor.logger.scalars = lambda step, values: logged.__setitem__(step, values)

    def step(step_number, start, data_seconds, seconds, result):
        clock.now = start
        processor.begin_step()
        with processor.waiting_for_data():
            clock.now += data_seconds
        clock.now = start + seconds
        processor.end_step(step_number, result, skipped_steps=0 if result.applied else 1)

    caplog.set_level(logging.INFO, logger="sana2")
    step(1, 0.0, 0.5, 2.0, _step_result([1.0, 2.0], [0.1, 0.6]))
    assert logged == {}  # not a log step
    # a validation or a save took 6 s between the steps: not part of any step's time
    step(2, 8.0, 0.0, 4.0, _step_result([math.nan, math.nan], [0.3, 0.9], applied=False))
    values = logged[2]
    assert values["step_seconds"] == 3.0 and values["data_wait_share"] == 0.5 / 6
    assert values["samples_per_second"] == 16 / 6 and values["tokens_per_second"] == 1024 / 6
    assert values["mfu"] == 6 * 1000 * 1024 / 6 / 1e9
    assert values["skipped_steps"] == 1.0 and values["loss"] != values["loss"]  # the last step's (nan)
    # the skipped step's losses are left out of the per-noise-level means
    assert {k: v for k, v in values.items() if k.startswith("loss/")} == {
        "loss/sigma_0.00-0.25": 1.0,
        "loss/sigma_0.50-0.75": 2.0,
    }
    assert "eta 9s" in caplog.text  # 3 s per step so far, 3 steps to go

    step(3, 20.0, 0.0, 1.0, _step_result([4.0], [0.4]))
    step(4, 21.0, 0.0, 1.0, _step_result([6.0], [0.4]))
    assert logged[4]["step_seconds"] == 1.0 and logged[4]["data_wait_share"] == 0.0  # a new window
    assert logged[4]["loss/sigma_0.25-0.50"] == 5.0 and "loss/sigma_0.00-0.25" not in logged[4]
    step(5, 22.0, 0.0, 2.0, _step_result([1.0], [0.1]))
    assert sorted(logged) == [2, 4, 5]  # the last step always logs
    processor.close()


# -- Weights & Biases ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_wandb_gets_the_scalars_and_images_tensorboard_gets(tmp_path, monkeypatch):
    """Through one MetricLogger, an offline Weights & Biases run holds every scalar TensorBoard holds at the
    same steps, the same image grid, and the run's config."""
    pytest.importorskip("wandb").teardown()  # wandb keeps the settings it first read in the process
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    clock = FakeClock()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=clock))
    flags = ["--metrics.enable_wandb=true", "--metrics.enable_tensorboard=true", "--metrics.log_freq=2"]
    config = load_config(None, [f"--job.dump_folder={tmp_path / 'run'}", *flags, "--training.steps=4"])
    processor = MetricsProcessor(
        config.metrics,
        ParallelDims(1, 1),
        torch.device("cpu"),
        1000,
        total_steps=4,
        dump_folder=tmp_path / "run",
        config_text=config.to_json(),
    )
    for step in range(1, 5):
        clock.now = step
        processor.begin_step()
        clock.now = step + 0.5
        processor.end_step(step, _step_result([step / 10, 1.0], [0.1, 0.6]), skipped_steps=0)
    images = torch.linspace(-1, 1, 4 * 3 * 4 * 6).view(4, 3, 4, 6)
    processor.logger.images("validation/images", images, step=4, nrow=2)
    processor.logger.scalars(4, {"validation/loss": 0.25})
    processor.close()

    (tb_folder,) = (tmp_path / "run" / "tb").iterdir()
    events = EventAccumulator(str(tb_folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    (run_folder,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    history = wandb_history(run_folder)
    tags = events.Tags()["scalars"]
    assert {"loss", "step_seconds", "samples_per_second", "validation/loss", "memory/rank0/peak_rss_gib"} <= set(tags)
    for tag in tags:
        logged = {step: values[tag] for step, values in history.items() if tag in values}
        assert logged == pytest.approx({e.step: e.value for e in events.Scalars(tag)}, rel=1e-6), tag
    assert history[2]["loss"] == pytest.approx(0.6) and history[4]["step_seconds"] == 0.5
    (image,) = events.Images("validation/images")
    tensorboard_image = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"), dtype=int)
    wandb_image = np.asarray(Image.open(run_folder / "files" / history[4]["validation/images/path"]), dtype=int)
    assert wandb_image.shape == tensorboard_image.shape == (2 * 5 + 1, 2 * 7 + 1, 3)
    assert np.abs(wandb_image - tensorboard_image).max() <= 1  # each rounds the same [0, 1] grid to 8 bits
    runs = [r.run for r in wandb_offline_records(run_folder) if r.WhichOneof("record_type") == "run"]
    config_items = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config_items["metrics"]["enable_wandb"] is True and runs[0].display_name == "run"


def test_wandb_requested_but_not_installed_stops_before_the_run_with_exit_2(tmp_path, monkeypatch, capfd):
    from sana2.train import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as where it is not installed
    with pytest.raises(ConfigError, match="metrics.enable_wandb = true needs the wandb package"):
        load_config(None, ["--metrics.enable_wandb=true"])
    assert main([f"--job.dump_folder={tmp_path / 'run'}", "--metrics.enable_wandb=true"]) == 2
    error = capfd.readouterr().err
    assert "--metrics.enable_wandb=true: metrics.enable_wandb = true needs the wandb package" in error, error
    assert "pip install 'sana2[wandb]'" in error and "Traceback" not in error
    assert not (tmp_path / "run").exists()


def test_wandb_that_cannot_start_stops_the_run_with_exit_2_naming_the_key(tmp_path, monkeypatch, capfd):
    """Online without a login: one line naming metrics.enable_wandb and the two ways out, no traceback."""
    from sana2.train import main

    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # wandb keeps the settings it first read in the process (another test's offline mode)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home"))
    dump = tmp_path / "run"
    assert main([f"--job.dump_folder={dump}", "--metrics.enable_wandb=true", "--training.steps=1"]) == 2
    error = capfd.readouterr().err
    assert "metrics.enable_wandb: Weights & Biases did not start: No API key configured" in error, error
    assert "WANDB_MODE=offline" in error and "Traceback" not in error
    assert not list((dump / "checkpoint").glob("step-*"))  # stopped before any step
