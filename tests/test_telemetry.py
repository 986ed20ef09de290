"""Telemetry: timers, the steps_per_print log line, and the TensorBoard / CSV / W&B monitors."""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model
from zeroshard.config import load_config
from zeroshard.telemetry import StepRecord, Telemetry, timers
from zeroshard.telemetry.log import format_memory, format_step
from zeroshard.telemetry.telemetry import PROGRESS_ENV, REDUCTION_OPS

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
        "comm_wait_s": 0.002,
        "memory_bytes": 5 * 2**30,
    }
    return StepRecord(**{**values, **changes})


class _Clock:
    """A ``time`` stand-in whose ``perf_counter`` moves only when the test says: timings without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_timers_accumulate_and_cost_nothing_when_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    off = Telemetry(rank=0, world_size=1)
    assert off.timer("forward") is off.timer("backward")  # one shared no-op context manager
    with off.timer("forward"):
        pass
    assert off.timings() == {}

    clock = _Clock()
    monkeypatch.setattr(timers, "time", clock)
    on = Telemetry(rank=0, world_size=1, wall_clock_breakdown=True)
    for seconds in (0.25, 0.5, 1.0):
        with on.timer("forward"):
            clock.now += seconds
        clock.now += 7.0  # outside any timer: not counted
    with on.timer("step"):
        pass
    assert on.timings() == {"forward": 1.75, "step": 0.0}
    with pytest.raises(RuntimeError), on.timer("backward"):  # time is counted even when the block raises
        clock.now += 0.125
        raise RuntimeError("boom")
    assert on.timings()["backward"] == 0.125


def test_log_lines_every_steps_per_print_on_rank_0(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    telemetry = Telemetry.from_config(config(steps_per_print=2), rank=0, world_size=2)
    for step in range(1, 6):
        telemetry.on_step(record(step))
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert [line.split(" | ")[0] for line in lines] == ["step 2", "step 4"]
    assert lines[0] == (
        "step 2 | samples 16 | loss 1.0000 | lr 2.000e-03,5.000e-04 | grad norm 0.5 | skipped 0 | "
        "32.0 samples/s | memory 5 GiB | comm 3 MiB, wait 2.0 ms"
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
    assert step_line.endswith(" | comm 3 MiB, wait 2.0 ms")
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
    for name in (
        "grad_norm",
        "skipped_steps",
        "samples_per_sec",
        "memory_bytes",
        "comm_bytes",
        "comm_wait_ms",
    ):
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
        comm_wait_s=0.0,
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


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_engine_draws_no_progress_bar_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed draws no bar of its own and scripts draw theirs: two bars on one terminal overwrite each
    # other, so the engine's is opt-in even on a terminal.
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert not Telemetry.from_config(config(), rank=0, world_size=2).has_progress_bar
    monkeypatch.setenv(PROGRESS_ENV, "1")
    asked = Telemetry.from_config(config(), rank=0, world_size=2)
    assert asked.has_progress_bar and asked.reports
    assert not Telemetry.from_config(config(), rank=1, world_size=2).has_progress_bar
    asked.close()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file, not a terminal: no bar even when asked
    assert not Telemetry.from_config(config(), rank=0, world_size=2).has_progress_bar


def test_memory_of_every_rank_in_the_line() -> None:
    mib = 2**20
    assert format_memory([int(22.5 * mib)]) == "memory 22.5 MiB"
    assert format_memory([int(22.5 * mib), 23 * mib]) == "memory MiB r0 22.5 r1 23"
    many = [20 * mib] * 16
    many[3], many[9] = 25 * mib, 512 * 2**10
    assert format_memory(many) == "memory MiB max 25 (r3) min 0.5 (r9)"
    line = format_step(record(2, rank_memory_bytes=[2**30, 3 * 2**29]))
    assert " | memory GiB r0 1 r1 1.5 | " in line


# The library attaches no handler and sets no level: an unconfigured script sees no line, a configured
# one sees each line once through its own handler. pytest configures logging itself, so each case runs in
# a fresh interpreter.
_SCRIPT = """
import logging, sys
from zeroshard.telemetry import StepRecord, Telemetry

mode = sys.argv[1]
if mode == "configured":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="root: %(message)s")
telemetry = Telemetry(rank=0, world_size=1, steps_per_print=1)
if mode == "configured_later":  # after the engine was built, the telemetry logger alone at INFO
    logging.basicConfig(stream=sys.stdout, format="root: %(message)s")
    logging.getLogger("zeroshard.telemetry.telemetry").setLevel(logging.INFO)
logging.getLogger("zeroshard.runtime.build").info("the resolved config")
values = dict(global_samples=8, loss=1.5, lr=[1e-3], loss_scale=None, grad_norm=None, skipped_steps=0,
              step_time_s=0.1, samples_per_s=80.0, comm_bytes=0, comm_wait_s=0.0, memory_bytes=1024)
for step in (1, 2):
    telemetry.on_step(StepRecord(global_step=step, **values))
print("handlers", [type(h).__name__ for h in logging.getLogger("zeroshard.telemetry.telemetry").handlers])
"""


@pytest.mark.parametrize("mode", ["unconfigured", "configured", "configured_later"])
def test_log_lines_go_only_where_the_application_configured(mode: str) -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out, err = done.stdout, done.stderr
    assert "handlers []" in out  # the library added no handler of its own
    if mode == "unconfigured":
        assert "step 1" not in out + err and err == ""
        return
    assert ("the resolved config" in out) == (mode == "configured")  # root at INFO shows every INFO record
    for step in (1, 2):
        assert out.count(f"root: step {step} | samples 8 | loss 1.5000") == 1, (out, err)
    assert "step 1" not in err


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _one_engine(rank: int, stage: int) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
    }
    model = make_model(0)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    lines = _Lines()
    logging.getLogger(LOGGER).addHandler(lines)
    logging.getLogger(LOGGER).setLevel(logging.INFO)  # the application's choice: the library sets no level
    records: list[StepRecord] = []
    write = engine.telemetry.on_step

    def on_step(record: StepRecord) -> None:  # what rank 0 hands to the log line and the monitors
        records.append(record)
        write(record)

    engine.telemetry.on_step = on_step  # type: ignore[method-assign]
    losses, applied = [], []
    for step in range(2):
        for micro in range(2):
            loss = engine(*batch(step, micro, rank))
            losses.append(float(loss))
            engine.backward(loss)
            if micro == 1:
                applied.append(engine.get_lr())
            engine.step()
    logging.getLogger(LOGGER).removeHandler(lines)
    engine.destroy()
    waits = engine.comm.stats.wait_s_by_op
    return {
        "lines": lines.lines,
        "records": records,
        "losses": losses,
        "applied_lr": applied,
        "lr_after": engine.get_lr(),
        "memory": engine.memory_breakdown().total,
        "psi": 4 * sum(u.layout.padded for u in engine.units),
        "reduce_s": engine.telemetry.timings()["reduce"],
        "reduction_wait_s": sum(waits.get(op, 0.0) for op in REDUCTION_OPS),
    }


def engine_steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [_one_engine(rank, stage) for stage in (0, 1, 2)]


def test_engine_reports_global_loss_every_ranks_memory_and_comm_wait() -> None:
    per_rank = run_distributed(engine_steps, 2)
    for stage, (r0, r1) in enumerate(zip(*per_rank, strict=True)):
        assert r1["lines"] == [] and r1["records"] == []  # only rank 0 writes
        first, second = r0["records"]
        # Between print steps the ranks share nothing, so a global loss is not known there.
        assert first.loss is None and first.rank_memory_bytes is None
        # Step 2 (a print step): the mean over both ranks and both micro-batches, every rank's memory.
        assert second.loss == pytest.approx(sum(r0["losses"][2:] + r1["losses"][2:]) / 4, rel=1e-6)
        assert second.rank_memory_bytes == [r0["memory"], r1["memory"]]
        # The rate each step applied, not the scheduler's next one (the warmup moves it every step).
        assert [first.lr, second.lr] == r0["applied_lr"] and second.lr != r0["lr_after"]
        # Bytes follow the ZeRO volume (test_memory_and_comm): 2Ψ a step; stage 2 reduce-scatters each
        # micro-batch, so one more Ψ with two of them.
        psi = r0["psi"]
        assert first.comm_bytes == second.comm_bytes == {0: 2 * psi, 1: 2 * psi, 2: 3 * psi}[stage]
        # Time blocked on communication: > 0 at W=2, and the "reduce" timer counts every wait on a
        # gradient reduction, those inside the backward hooks included, not only the final one.
        assert first.comm_wait_s > 0 and second.comm_wait_s > 0
        assert r0["reduce_s"] == pytest.approx(r0["reduction_wait_s"]) and r0["reduce_s"] > 0
        assert first.comm_wait_s + second.comm_wait_s >= r0["reduce_s"]
        (line, timer_line) = r0["lines"]
        assert line.startswith("step 2 | samples 16 | loss ") and f"loss {second.loss:.4f}" in line
        assert " | memory " in line and " r0 " in line and " r1 " in line and ", wait " in line
        assert timer_line.startswith("time per step over the last 2 (ms): forward ")
