"""Telemetry: timers, the steps_per_print log line, and the TensorBoard / CSV / W&B monitors."""

from __future__ import annotations

import csv
import importlib.util
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from zeroshard.config import load_config
from zeroshard.telemetry import StepRecord, Telemetry
from zeroshard.telemetry.telemetry import format_step

LOGGER = "zeroshard.telemetry.telemetry"


def config(**extra: Any) -> Any:
    return load_config({"train_batch_size": 8, **extra}, world_size=2)


def record(step: int, **changes: Any) -> StepRecord:
    values: dict[str, Any] = {
        "global_step": step,
        "global_samples": 8 * step,
        "loss": 2.0 / step,
        "lr": [1e-3 * step, 5e-4],
        "loss_scale": None,
        "grad_norm": 0.5,
        "skipped_steps": 0,
        "step_time_s": 0.25,
        "samples_per_s": 32.0,
        "comm_bytes": 3 * 2**20,
        "memory_bytes": 5 * 2**30,
    }
    return StepRecord(**{**values, **changes})


def test_timers_accumulate_and_cost_nothing_when_disabled() -> None:
    off = Telemetry(rank=0, world_size=1)
    assert off.timer("forward") is off.timer("backward")  # one shared no-op context manager
    with off.timer("forward"):
        pass
    assert off.timings() == {}

    on = Telemetry(rank=0, world_size=1, wall_clock_breakdown=True)
    for _ in range(3):
        with on.timer("forward"):
            time.sleep(0.01)
    with on.timer("step"):
        pass
    timings = on.timings()
    assert set(timings) == {"forward", "step"}
    assert 0.03 <= timings["forward"] < 1.0 and timings["step"] < timings["forward"]
    with pytest.raises(RuntimeError), on.timer("backward"):  # time is counted even when the block raises
        raise RuntimeError("boom")
    assert "backward" in on.timings()


def test_log_lines_every_steps_per_print_on_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    telemetry = Telemetry.from_config(config(steps_per_print=2), rank=0, world_size=2)
    for step in range(1, 6):
        telemetry.on_step(record(step))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [line.split(" | ")[0] for line in lines] == ["step 2", "step 4"]
    assert lines[0] == (
        "step 2 | samples 16 | loss 1.0000 | lr 2.000e-03,5.000e-04 | grad norm 0.5 | skipped 0 | "
        "32.0 samples/s | memory 5 GiB | comm 3 MiB"
    )
    caplog.clear()
    other = Telemetry.from_config(config(steps_per_print=1), rank=1, world_size=2)
    other.on_step(record(1))
    assert not [r for r in caplog.records if r.name == LOGGER]  # only rank 0 logs
    caplog.clear()
    silent = Telemetry.from_config(config(), rank=0, world_size=2)  # steps_per_print defaults to None: off
    silent.on_step(record(1))
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert (telemetry.reports, other.reports, silent.reports) == (True, False, False)


def test_log_line_with_loss_scale_and_timers(caplog: pytest.LogCaptureFixture) -> None:
    assert "loss scale 65536" in format_step(record(1, loss_scale=65536.0))
    assert "loss" not in format_step(record(1, loss=None)).replace("loss scale", "")
    caplog.set_level(logging.INFO, logger=LOGGER)
    telemetry = Telemetry.from_config(
        config(steps_per_print=2, wall_clock_breakdown=True), rank=0, world_size=2
    )
    for step in (1, 2):
        for name in ("forward", "backward", "reduce", "step"):
            with telemetry.timer(name):
                pass
        telemetry.on_step(record(step))
    step_line, timer_line = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert step_line.endswith(" ms") and " | comm 3 MiB in " in step_line
    assert timer_line.startswith("time per step over the last 2 (ms): forward ")
    assert " | backward " in timer_line and " | reduce " in timer_line and " | step " in timer_line


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_deepspeeds_events_at_global_samples(tmp_path: Path) -> None:
    cfg = config(
        tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "run1"},
        wall_clock_breakdown=True,
    )
    telemetry = Telemetry.from_config(cfg, rank=0, world_size=2)
    for step in (1, 2, 3):
        with telemetry.timer("forward"):
            pass
        telemetry.on_step(record(step, loss_scale=2.0**step))
    telemetry.close()
    telemetry.close()  # closing twice is harmless
    scalars = _scalars(tmp_path / "run1")
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == [8, 16, 24]
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx([2.0, 1.0, 2 / 3])
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert [v for _, v in scalars["Train/Samples/loss_scale"]] == [2.0, 4.0, 8.0]
    assert len(scalars["Train/Samples/elapsed_time_ms_forward"]) == 3
    for name in ("grad_norm", "skipped_steps", "samples_per_sec", "memory_bytes", "comm_bytes"):
        assert len(scalars[f"Train/Samples/{name}"]) == 3, name
    assert "Train/Samples/elapsed_time_ms_step" not in scalars  # never timed, never written


def test_only_rank_0_writes_monitors(tmp_path: Path) -> None:
    cfg = config(
        tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "j"},
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "c"},
    )
    telemetry = Telemetry.from_config(cfg, rank=1, world_size=2)
    telemetry.on_step(record(1))
    telemetry.close()
    assert list(tmp_path.iterdir()) == []


def test_csv_monitor_writes_one_file_per_event(tmp_path: Path) -> None:
    cfg = config(csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "job"})
    for run in range(2):  # a second run (a resumed job) appends under the same single header
        telemetry = Telemetry.from_config(cfg, rank=0, world_size=2)
        for step in (1, 2):
            telemetry.on_step(record(step + 2 * run, loss=None if step == 2 else 1.5))
        telemetry.close()
    with (tmp_path / "job" / "Train_Samples_lr.csv").open() as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["step", "lr"]
    assert [int(r[0]) for r in rows[1:]] == [8, 16, 24, 32]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])
    with (tmp_path / "job" / "Train_Samples_train_loss.csv").open() as file:
        rows = list(csv.reader(file))
    assert rows == [["step", "train_loss"], ["8", "1.5"], ["24", "1.5"]]  # no loss given, no row
    assert not (tmp_path / "job" / "Train_Samples_loss_scale.csv").exists()  # None without fp16


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(wandb={"enabled": True, "project": "zeroshard-tests", "group": "ci"})
    telemetry = Telemetry.from_config(cfg, rank=0, world_size=2)
    for step in (1, 2):
        telemetry.on_step(record(step))
    telemetry.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.parametrize(("key", "package"), [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_monitor_package_names_the_key_and_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, key: str, package: str
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a)
    )
    cfg = config(**{key: {"enabled": True}})
    for rank in (0, 1):  # every rank fails alike, so none waits for the others
        with pytest.raises(ImportError) as err:
            Telemetry.from_config(cfg, rank=rank, world_size=2)
        message = str(err.value)
        assert f"{key}.enabled is true" in message and f"pip install 'zeroshard[{package}]'" in message


def test_progress_bar_counts_steps_on_rank_0_only() -> None:
    from zeroshard.telemetry import StepRecord, Telemetry

    record = StepRecord(
        global_step=1,
        global_samples=4,
        loss=1.5,
        lr=[1e-3],
        loss_scale=None,
        grad_norm=None,
        skipped_steps=0,
        step_time_s=0.1,
        samples_per_s=40.0,
        comm_bytes=0,
        memory_bytes=0,
    )
    shown = Telemetry(rank=0, world_size=2, progress=True)
    hidden = Telemetry(rank=1, world_size=2, progress=True)
    assert shown.reports and not hidden.reports
    for _ in range(3):
        shown.on_step(record)
        hidden.on_step(record)
    assert shown._bar is not None and shown._bar.n == 3 and hidden._bar is None
    shown.close()
