"""`Telemetry`: the engine's timers, its `steps_per_print` log line and the config's monitors, in one object.

The engine makes one with `Telemetry.from_config(config, rank, world_size)`, wraps its phases in
`telemetry.timer(name)`, calls `on_step(StepRecord(...))` after every optimizer step and `close()` at the
end. Rank 0 logs and writes the monitors; every rank keeps its own timings.

[Note: telemetry events]
Written at x = `global_samples` after the step, the x-axis DeepSpeed uses. DeepSpeed's names:
`Train/Samples/train_loss` (when the loss is known), `Train/Samples/lr` (first param group),
`Train/Samples/loss_scale` (fp16 only) and, with `wall_clock_breakdown`, the step's
`Train/Samples/elapsed_time_ms_{forward,backward,backward_allreduce,step}` from the timers "forward",
"backward", "reduce" and "step". zeroshard adds `Train/Samples/grad_norm`, `Train/Samples/skipped_steps`,
`Train/Samples/samples_per_sec`, `Train/Samples/memory_bytes` and `Train/Samples/comm_bytes`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from zeroshard.config import ZeroshardConfig
from zeroshard.telemetry.monitors import Event, Monitor, build_monitors, check_available
from zeroshard.telemetry.record import StepRecord
from zeroshard.telemetry.timers import TIMER_NAMES, Timers

__all__ = ["Telemetry", "format_bytes", "format_step"]

logger = logging.getLogger(__name__)

PREFIX = "Train/Samples/"
_TIMER_EVENTS = {"forward": "forward", "backward": "backward", "reduce": "backward_allreduce", "step": "step"}


def format_bytes(nbytes: float) -> str:
    """Binary units, three significant figures: "512 B", "3.25 MiB", "12.3 GiB"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # the loop returns at GiB


def format_step(record: StepRecord, reduce_s: float | None = None) -> str:
    """The `steps_per_print` log line of one step."""
    parts = [f"step {record.global_step}", f"samples {record.global_samples}"]
    if record.loss is not None:
        parts.append(f"loss {record.loss:.4f}")
    if record.lr:
        parts.append("lr " + ",".join(f"{lr:.3e}" for lr in record.lr))
    if record.loss_scale is not None:
        parts.append(f"loss scale {record.loss_scale:g}")
    if record.grad_norm is not None:
        parts.append(f"grad norm {record.grad_norm:.4g}")
    parts += [
        f"skipped {record.skipped_steps}",
        f"{record.samples_per_s:.1f} samples/s",
        f"memory {format_bytes(record.memory_bytes)}",
        f"comm {format_bytes(record.comm_bytes)}"
        + ("" if reduce_s is None else f" in {reduce_s * 1e3:.1f} ms"),
    ]
    return " | ".join(parts)


class Telemetry:
    """Timers, log lines and monitors of one rank (see [Note: telemetry events]).

    Invariant: only rank 0 has monitors and logs; `timings()` is this rank's own.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        steps_per_print: int | None = None,
        wall_clock_breakdown: bool = False,
        monitors: Sequence[Monitor] = (),
        progress: bool = False,
    ) -> None:
        self.rank = rank
        # A progress bar only for a person watching rank 0's terminal; logs and pipes get log lines.
        self._bar = _progress_bar() if progress and rank == 0 else None
        self.world_size = world_size
        self.steps_per_print = steps_per_print
        self.monitors = list(monitors) if rank == 0 else []
        self._timers = Timers(wall_clock_breakdown)
        self._at_last_step: dict[str, float] = {}
        self._at_last_print: dict[str, float] = {}
        self._steps_since_print = 0
        self._closed = False

    @classmethod
    def from_config(cls, config: ZeroshardConfig, rank: int, world_size: int) -> Telemetry:
        """Builds the telemetry a config asks for: `steps_per_print`, `wall_clock_breakdown` and the
        `tensorboard`, `csv_monitor` and `wandb` monitors (opened on rank 0 only).

        Collective in effect: call on every rank; each checks the monitors' packages, so a missing one
        fails on all ranks alike.

        Raises:
            ImportError: When an enabled monitor's package is missing (the message names the key and the pip
                command).
        """
        check_available(config)
        monitors = build_monitors(config) if rank == 0 else []
        return cls(
            rank=rank,
            world_size=world_size,
            steps_per_print=config.steps_per_print,
            wall_clock_breakdown=config.wall_clock_breakdown,
            monitors=monitors,
            progress=sys.stderr.isatty(),
        )

    @property
    def timers_enabled(self) -> bool:
        return self._timers.enabled

    @property
    def reports(self) -> bool:
        """Whether `on_step` writes anything on this rank (rank 0 with `steps_per_print` or a monitor).

        The engine may skip work only a report needs (the loss's `.item()`, which waits for the device,
        or measuring memory) when this is False.
        """
        return self.rank == 0 and (bool(self.steps_per_print) or bool(self.monitors) or self._bar is not None)

    def timer(self, name: str) -> AbstractContextManager[None]:
        """Times the block inside under `name` ("forward", "backward", "reduce", "step"); a shared no-op
        context manager when `wall_clock_breakdown` is off."""
        return self._timers.timer(name)

    def timings(self) -> dict[str, float]:
        """Total seconds per timer name on this rank so far (empty when `wall_clock_breakdown` is off)."""
        return self._timers.timings()

    def on_step(self, record: StepRecord) -> None:
        """Reports one optimizer step: monitors on every step, a log line every `steps_per_print` steps.

        Local: no communication; call on every rank after each optimizer step.
        """
        totals = self._timers.timings()
        step_times = {k: v - self._at_last_step.get(k, 0.0) for k, v in totals.items()}
        self._at_last_step = totals
        self._steps_since_print += 1
        if self.rank != 0:
            return
        if self._bar is not None:
            loss = "" if record.loss is None else f"loss {record.loss:.4f} "
            lr = f"lr {record.lr[0]:.2e}" if record.lr else ""
            self._bar.set_postfix_str(loss + lr, refresh=False)
            self._bar.update(1)
        if self.monitors:
            events = self._events(record, step_times)
            for monitor in self.monitors:
                monitor.write_events(events)
        if self.steps_per_print and record.global_step % self.steps_per_print == 0:
            logger.info("%s", format_step(record, step_times.get("reduce") if self.timers_enabled else None))
            if self.timers_enabled:
                logger.info("%s", self._timer_line(totals))
            self._at_last_print = totals
            self._steps_since_print = 0

    def _timer_line(self, totals: dict[str, float]) -> str:
        steps = max(self._steps_since_print, 1)
        names = [n for n in TIMER_NAMES if n in totals] + sorted(set(totals) - set(TIMER_NAMES))
        means = [f"{n} {(totals[n] - self._at_last_print.get(n, 0.0)) / steps * 1e3:.2f}" for n in names]
        return f"time per step over the last {steps} (ms): " + " | ".join(means)

    @staticmethod
    def _events(record: StepRecord, step_times: dict[str, float]) -> list[Event]:
        x = record.global_samples
        values: list[tuple[str, float | None]] = [
            ("train_loss", record.loss),
            ("lr", record.lr[0] if record.lr else None),
            ("loss_scale", record.loss_scale),
        ]
        values += [(f"elapsed_time_ms_{_TIMER_EVENTS.get(n, n)}", s * 1e3) for n, s in step_times.items()]
        values += [
            ("grad_norm", record.grad_norm),
            ("skipped_steps", record.skipped_steps),
            ("samples_per_sec", record.samples_per_s),
            ("memory_bytes", record.memory_bytes),
            ("comm_bytes", record.comm_bytes),
        ]
        return [(PREFIX + name, float(value), x) for name, value in values if value is not None]

    def close(self) -> None:
        """Flushes and closes the monitors; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        for monitor in self.monitors:
            monitor.close()


def _progress_bar() -> Any:
    """A tqdm bar counting optimizer steps, or None when tqdm is not installed (an optional extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="step", desc="zeroshard", dynamic_ncols=True)
