"""`Telemetry`: the engine's timers, its `steps_per_print` log line and the config's monitors, in one object.

The engine makes one with `Telemetry.from_config(config, rank, world_size, comm)` and, on every rank, hands
it each micro-batch's loss (`add_loss`), wraps its phases in `timer(name)` and its backward in
`reduce_timer()`, calls `end_step(...)` after every optimizer step and `close()` at the end. Rank 0 logs
(to stderr when the script configured no logging: see zeroshard/telemetry/log.py) and writes the monitors;
every rank keeps its own timings.

[Note: telemetry events]
Written at x = `global_samples` after the step, the x-axis DeepSpeed uses. DeepSpeed's names:
`Train/Samples/train_loss` (when the loss is known), `Train/Samples/lr` (first param group, the rate the
step applied), `Train/Samples/loss_scale` (fp16 only) and, with `wall_clock_breakdown`, the step's
`Train/Samples/elapsed_time_ms_{forward,backward,backward_allreduce,step}` from the timers "forward",
"backward", "reduce" and "step" ("reduce": the time blocked on gradient reductions, see `reduce_timer`).
zeroshard adds `Train/Samples/grad_norm`, `Train/Samples/skipped_steps`, `Train/Samples/samples_per_sec`,
`Train/Samples/memory_bytes`, `Train/Samples/comm_bytes` and `Train/Samples/comm_wait_ms` (rank 0's).

[Note: telemetry collectives]
A report's loss is the mean over all ranks and its memory is every rank's, so reporting a step may need the
other ranks. At a `steps_per_print` step every rank adds its loss to the others' (one 2-element all-reduce)
and shares its memory (one int64 all-gather); at other steps the loss is all-reduced only when the config
enables a monitor, since monitors write every step. Whether a step is shared depends only on the config
and the step number, the same on every rank, and the engine calls `end_step` on every rank at every
accumulation boundary, so all ranks take the same collectives in the same order. Between reports the
micro-batch losses stay on the device (no host sync per micro-batch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from zeroshard.config import ZeroshardConfig
from zeroshard.core.comm import Comm, CommStats
from zeroshard.telemetry.log import format_bytes, format_step
from zeroshard.telemetry.monitors import Event, Monitor, build_monitors, check_available, monitors_enabled
from zeroshard.telemetry.record import StepRecord
from zeroshard.telemetry.timers import DISABLED, TIMER_NAMES, Timers

__all__ = ["PROGRESS_ENV", "REDUCTION_OPS", "Telemetry", "format_bytes", "format_step"]

logger = logging.getLogger(__name__)

PREFIX = "Train/Samples/"
_TIMER_EVENTS = {"forward": "forward", "backward": "backward", "reduce": "backward_allreduce", "step": "step"}

PROGRESS_ENV = "ZEROSHARD_PROGRESS_BAR"
"""Set to 1 to have rank 0 draw a progress bar when its stderr is a terminal (off by default, as in
DeepSpeed: the training script usually draws its own)."""

REDUCTION_OPS = ("all_reduce", "reduce_scatter")
"""The kinds of collective (`CommStats` keys) that reduce gradients; the "reduce" timer counts their waits."""


class Telemetry:
    """Timers, log lines and monitors of one rank (see [Note: telemetry events]).

    Invariant: only rank 0 has monitors and a progress bar and logs; `timings()` is this rank's own.

    Args:
        rank, world_size: This rank in the data-parallel group.
        steps_per_print: Log a line every this many optimizer steps (None or 0: never).
        wall_clock_breakdown: Time forward, backward, reduce and step.
        monitors: The monitors rank 0 writes (other ranks' are dropped).
        monitored: Whether the config enables a monitor, the same on every rank (unlike `monitors`, which
            only rank 0 opens); by default whether `monitors` is non-empty.
        progress: Draw a progress bar on rank 0 (needs tqdm).
        comm: The data-parallel group, for the communication figures and the collectives of
            [Note: telemetry collectives]; None reports this rank's own figures only.
        train_batch_size: Samples per optimizer step over all ranks, for samples/s.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        steps_per_print: int | None = None,
        wall_clock_breakdown: bool = False,
        monitors: Sequence[Monitor] = (),
        monitored: bool | None = None,
        progress: bool = False,
        comm: Comm | None = None,
        train_batch_size: int = 0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.steps_per_print = steps_per_print
        self.monitors = list(monitors) if rank == 0 else []
        self._monitored = bool(monitors) if monitored is None else monitored
        # A progress bar only for a person watching rank 0's terminal; logs and pipes get log lines.
        self._bar = _progress_bar() if progress and rank == 0 else None
        self._bar_loss: float | None = None
        self._comm = comm
        self.train_batch_size = train_batch_size
        """Samples per optimizer step over all ranks (``engine.set_train_batch_size`` updates it)."""
        self._timers = Timers(wall_clock_breakdown)
        # Every rank that may have to share its loss keeps it (see [Note: telemetry collectives]).
        self._keeps_loss = bool(steps_per_print) or self._monitored or self._bar is not None
        self._losses: list[torch.Tensor] = []
        self._last_step_end = time.perf_counter()
        self._comm_at_last_step = _comm_totals(comm.stats) if comm is not None else (0, 0.0, 0)
        self._at_last_step: dict[str, float] = {}
        self._at_last_print: dict[str, float] = {}
        self._steps_since_print = 0
        self._closed = False

    @property
    def monitored(self) -> bool:
        """Whether the config enables a monitor (the same on every rank; only rank 0 holds them)."""
        return self._monitored

    @classmethod
    def from_config(
        cls, config: ZeroshardConfig, rank: int, world_size: int, comm: Comm | None = None
    ) -> Telemetry:
        """Builds the telemetry a config asks for: `steps_per_print`, `wall_clock_breakdown` and the
        `tensorboard`, `csv_monitor` and `wandb` monitors (opened on rank 0 only); a progress bar when
        `$ZEROSHARD_PROGRESS_BAR` is 1 and rank 0's stderr is a terminal.

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
            monitored=monitors_enabled(config),
            progress=_progress_requested(),
            comm=comm,
            train_batch_size=config.train_batch_size,
        )

    @property
    def timers_enabled(self) -> bool:
        return self._timers.enabled

    @property
    def has_progress_bar(self) -> bool:
        """Whether this rank draws a progress bar (a script should then not draw its own)."""
        return self._bar is not None

    @property
    def reports(self) -> bool:
        """Whether this rank writes anything (rank 0 with `steps_per_print`, a monitor or a progress bar)."""
        return self.rank == 0 and (bool(self.steps_per_print) or bool(self.monitors) or self._bar is not None)

    def timer(self, name: str) -> AbstractContextManager[None]:
        """Times the block inside under `name` ("forward", "backward", "reduce", "step"); a shared no-op
        context manager when `wall_clock_breakdown` is off."""
        return self._timers.timer(name)

    def add_times(self, seconds: dict[str, float]) -> None:
        """Adds durations measured elsewhere (one each), e.g. the phases of an offloaded step; nothing when
        `wall_clock_breakdown` is off."""
        for name, value in seconds.items():
            self._timers.add(name, value)

    def reduce_timer(self) -> AbstractContextManager[None]:
        """Adds to the "reduce" timer the time this rank is blocked on gradient reductions inside the block.

        The reducer launches reductions from the gradient hooks while `loss.backward()` runs and, without
        `overlap_comm`, waits for each there, so timing only the final wait would miss most of it: this
        counts every wait on a gradient reduction (`REDUCTION_OPS`) inside the block, wherever it happens.
        A shared no-op when `wall_clock_breakdown` is off.
        """
        if not self._timers.enabled or self._comm is None:
            return DISABLED
        return self._reduce_wait(self._comm.stats)

    @contextlib.contextmanager
    def _reduce_wait(self, stats: CommStats) -> Iterator[None]:
        before = _reduction_wait_s(stats)
        try:
            yield
        finally:
            self._timers.add("reduce", max(_reduction_wait_s(stats) - before, 0.0))

    def timings(self) -> dict[str, float]:
        """Total seconds per timer name on this rank so far (empty when `wall_clock_breakdown` is off)."""
        return self._timers.timings()

    def add_loss(self, loss: torch.Tensor) -> None:
        """Keeps one micro-batch's loss, as the script computed it, for its step's report.

        Local and without a host sync: the loss stays a device tensor until a report reads it.
        """
        if self._keeps_loss:
            self._losses.append(loss.detach())

    def end_step(
        self,
        *,
        global_step: int,
        global_samples: int,
        lr: list[float],
        loss_scale: float | None,
        grad_norm: float | None,
        skipped_steps: int,
        memory_bytes: Callable[[], int],
    ) -> None:
        """Reports one optimizer step from the engine's figures and this object's own (time, loss, comm).

        Collective: call on every rank after every optimizer step, skipped ones included; at some steps it
        communicates (see [Note: telemetry collectives]). `memory_bytes` is called only when reported.
        """
        now = time.perf_counter()
        elapsed, self._last_step_end = now - self._last_step_end, now
        comm_bytes, comm_wait_s, cross_node_bytes = self._comm_since_last_step()
        losses, self._losses = self._losses, []
        printed = bool(self.steps_per_print) and global_step % (self.steps_per_print or 1) == 0
        shared = self._comm is not None and self.world_size > 1 and (printed or self._monitored)
        if not (shared or self.reports):
            return
        loss = self._mean_loss(losses, shared)
        memory = memory_bytes() if self.rank == 0 or (shared and printed) else 0
        per_rank = None
        if shared and printed and self._comm is not None:
            per_rank = self._comm.agree(memory, what="telemetry: every rank's memory")
        if self.rank != 0:
            return
        self.on_step(
            StepRecord(
                global_step=global_step,
                global_samples=global_samples,
                loss=loss,
                lr=lr,
                loss_scale=loss_scale,
                grad_norm=grad_norm,
                skipped_steps=skipped_steps,
                step_time_s=elapsed,
                samples_per_s=self.train_batch_size / elapsed if elapsed > 0 else 0.0,
                comm_bytes=comm_bytes,
                comm_wait_s=comm_wait_s,
                cross_node_bytes=cross_node_bytes,
                memory_bytes=memory,
                rank_memory_bytes=per_rank,
            )
        )

    def _mean_loss(self, losses: list[torch.Tensor], shared: bool) -> float | None:
        """The mean micro-batch loss over all ranks (collective when `shared`); None when not known here."""
        if shared and self._comm is not None:
            mine = torch.zeros(2, dtype=torch.float64)
            if losses:  # [sum, count], on the losses' device: one small copy, one host sync in tolist()
                summed = torch.stack(losses).double().sum()
                mine = torch.stack([summed, summed.new_tensor(float(len(losses)))])
            total, count = self._comm.sum_scalar(mine, what="telemetry: loss all_reduce").tolist()
            return float(total / count) if count else None
        if self.world_size > 1 or not losses:
            return None  # only this rank's loss is here, and the report says the loss is global
        return float(torch.stack(losses).double().mean())

    def _comm_since_last_step(self) -> tuple[int, float, int]:
        """Bytes, seconds waited and bytes sent to other nodes since the last step."""
        if self._comm is None:
            return 0, 0.0, 0
        now, last = _comm_totals(self._comm.stats), self._comm_at_last_step
        self._comm_at_last_step = now
        if any(n < m for n, m in zip(now, last, strict=True)):  # the counters were reset since (build.py)
            return now
        return now[0] - last[0], now[1] - last[1], now[2] - last[2]

    def on_step(self, record: StepRecord) -> None:
        """Writes one step's record: the progress bar and monitors every step, a log line every
        `steps_per_print` steps.

        Local: no communication; `end_step` calls it on rank 0 (other ranks return at once).
        """
        totals = self._timers.timings()
        step_times = {k: v - self._at_last_step.get(k, 0.0) for k, v in totals.items()}
        self._at_last_step = totals
        self._steps_since_print += 1
        if self.rank != 0:
            return
        if self._bar is not None:
            # The loss is gathered at some steps only ([Note: telemetry collectives]): show the last one.
            self._bar_loss = record.loss if record.loss is not None else self._bar_loss
            loss = "" if self._bar_loss is None else f"loss {self._bar_loss:.4f} "
            lr = f"lr {record.lr[0]:.2e}" if record.lr else ""
            self._bar.set_postfix_str(loss + lr, refresh=False)
            self._bar.update(1)
        if self.monitors:
            events = self._events(record, step_times)
            for monitor in self.monitors:
                monitor.write_events(events)
        if self.steps_per_print and record.global_step % self.steps_per_print == 0:
            logger.info("%s", format_step(record))
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
            ("comm_wait_ms", record.comm_wait_s * 1e3),
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


def _comm_totals(stats: CommStats) -> tuple[int, float, int]:
    return stats.total_bytes, stats.total_wait_s, stats.cross_node_bytes


def _reduction_wait_s(stats: CommStats) -> float:
    return sum(stats.wait_s_by_op.get(op, 0.0) for op in REDUCTION_OPS)


def _progress_requested() -> bool:
    """`$ZEROSHARD_PROGRESS_BAR` is 1 (or true, yes, on) and stderr, where tqdm draws, is a terminal."""
    asked = os.environ.get(PROGRESS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}
    return asked and sys.stderr.isatty()


def _progress_bar() -> Any:
    """A tqdm bar counting optimizer steps, or None when tqdm is not installed (an optional extra)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit="step", desc="zeroshard", dynamic_ncols=True)
