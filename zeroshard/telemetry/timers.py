"""Wall-clock timers for `wall_clock_breakdown`: forward, backward, reduce and step."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch

__all__ = ["DISABLED", "TIMER_NAMES", "Timers", "synchronize_device"]

TIMER_NAMES = ("forward", "backward", "reduce", "step")
"""The phases the engine times; any other name is accepted too."""

DISABLED: AbstractContextManager[None] = (
    contextlib.nullcontext()
)  # reusable and reentrant: one for every call


class Timers:
    """Accumulates wall-clock seconds per name.

    When disabled, `timer()` returns one shared no-op context manager: the cost is a call and an attribute
    check. When enabled on CUDA, each timer synchronizes the device at its start and end, so the time is
    that of the kernels and not of their launch (DeepSpeed's `wall_clock_breakdown` costs the same).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._totals: defaultdict[str, float] = defaultdict(float)
        self._counts: defaultdict[str, int] = defaultdict(int)

    def timer(self, name: str) -> AbstractContextManager[None]:
        """A context manager that adds the time spent inside it to `name`'s total."""
        if not self.enabled:
            return DISABLED
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        synchronize_device()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize_device()
            self._totals[name] += time.perf_counter() - start
            self._counts[name] += 1

    def add(self, name: str, seconds: float) -> None:
        """Adds a duration measured elsewhere to `name` (one run); nothing when disabled."""
        if self.enabled:
            self._totals[name] += seconds
            self._counts[name] += 1

    def timings(self) -> dict[str, float]:
        """Total seconds per timer name since this object was made (empty when disabled)."""
        return dict(self._totals)

    def counts(self) -> dict[str, int]:
        """How many times each timer ran."""
        return dict(self._counts)


def synchronize_device() -> None:
    """Wait for the CUDA device's queued work, where a CUDA context exists already (never makes one)."""
    # Only a CUDA context that exists already: timing must not create one on a CPU run.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
