"""``engine.tput_timer``: DeepSpeed's throughput timer, with its fields and their meaning.

[Note: throughput timer]
The engine starts the timer at each ``forward`` and stops it at each ``step`` (``global_step`` on the
accumulation boundary), as DeepSpeed's engine does when it has no training data loader of its own. So:

- ``micro_step_count`` counts stopped micro-steps, ``global_step_count`` the boundaries among them;
- the time from a forward to its ``step`` is measured only from global step ``start_step`` on (the first
  steps warm up), and adds to ``total_elapsed_time`` and, until the next boundary, ``step_elapsed_time``;
- ``avg_samples_per_sec()`` is ``batch_size`` (the global batch, ``train_batch_size``) over the mean
  measured time per optimizer step; ``-inf`` before any step was measured (DeepSpeed divides by zero
  when exactly ``start_step`` steps were taken).

With ``timers.throughput.synchronized`` the device is synchronized at each start and stop, so the time is
the kernels' (a CUDA context is never created for it); ``timers.throughput.enabled: false`` makes start and
stop do nothing. The engine passes ``report_speed=False``: its ``steps_per_print`` line reports samples/s
already, so the timer does not log a second line; a timer made by hand logs every ``steps_per_output``
global steps through ``logging_fn``, as DeepSpeed's does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from zeroshard.telemetry.timers import synchronize_device

__all__ = ["ThroughputTimer"]

log = logging.getLogger(__name__)

_EPSILON = 1e-6  # seconds, against a zero-length step in the current-rate figure


class _TimerConfig(Protocol):
    enabled: bool
    synchronized: bool


class ThroughputTimer:
    """Samples per second over the optimizer steps after ``start_step`` (see [Note: throughput timer]).

    Args:
        config: Has ``enabled`` and ``synchronized`` (the ``timers.throughput`` block).
        batch_size: Samples per optimizer step; None counts 1.
        start_step: Global steps not measured at the start.
        steps_per_output: Log the rate every this many global steps (None: never).
        monitor_memory: Also log the host's memory and swap use (needs psutil).
        logging_fn: Where the lines go (default: this module's logger at INFO).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], Any] | None = None,
    ) -> None:
        self.config: _TimerConfig = config
        self.start_time = 0.0
        self.end_time = 0.0
        self.started = False
        self.initialized = False
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory
        self.logging: Callable[[str], Any] = logging_fn or log.info
        if monitor_memory:
            import psutil  # noqa: F401  - DeepSpeed raises ImportError here too when it is missing

    def update_epoch_count(self) -> None:
        """A new epoch: count it and restart the micro-step count."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Begin a micro-step (the clock runs from global step ``start_step`` on)."""
        if not self.config.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                synchronize_device()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """End the micro-step begun by :meth:`start`; ``global_step``: it ended an optimizer step."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            synchronize_device()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        if report_speed and self.steps_per_output and self.global_step_count % self.steps_per_output == 0:
            self._report()
        self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the measured optimizer steps; ``-inf`` before the first."""
        measured = self.global_step_count - self.start_step
        if measured <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / measured)

    def _report(self) -> None:
        where = f"epoch={self.epoch_count}/micro_step={self.micro_step_count}"
        where += f"/global_step={self.global_step_count}"
        current = self.batch_size / (self.step_elapsed_time + _EPSILON)
        average = self.avg_samples_per_sec()
        self.logging(f"{where}, RunningAvgSamplesPerSec={average}, CurrSamplesPerSec={current}")
        if self.monitor_memory:
            import psutil

            memory, swap = psutil.virtual_memory().percent, psutil.swap_memory().percent
            self.logging(f"{where}, vm %: {memory}, swap %: {swap}")
