"""``disable_python_gc``: Python's automatic cyclic garbage collector off while an engine lives.

[Note: Python GC switch]
DeepSpeed 0.19.8 reads a top-level ``"disable_python_gc": true``. A collector pause on one rank stalls every
rank at the next collective, so large jobs turn automatic collection off and call
``engine.collect_python_gc()`` where a pause costs nothing (between steps, around a checkpoint). The switch
is process-wide and counted, as DeepSpeed's: the first engine that holds it collects once and turns the
collector off (if it was on); the last to let go (``engine.destroy()``, or the engine being garbage
collected) turns it back on. A process forked while it is held (a DataLoader worker) starts with the
collector as it was before, and the handles it inherited do nothing there.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["hold_python_gc"]

log = logging.getLogger(__name__)


class _Switch:
    """The process's count of holders (see [Note: Python GC switch])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._restore = False  # whether the collector was on before the first holder
        self._generation = 0  # bumped in a forked child: handles from the parent are then stale
        os.register_at_fork(after_in_child=self._reset_in_child)

    def hold(self) -> Callable[[], None]:
        with self._lock:
            if self._holders == 0:
                self._restore = gc.isenabled()
                if self._restore:
                    found = gc.collect()
                    gc.disable()
                    log.info("automatic Python GC off (disable_python_gc) after collecting %d objects", found)
            self._holders += 1
            generation = self._generation
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released or generation != self._generation:
                    return
                released = True
                self._holders -= 1
                if self._holders == 0 and self._restore:
                    gc.enable()
                    log.info("automatic Python GC back on: no engine holds disable_python_gc")

        return release

    def _reset_in_child(self) -> None:
        if self._holders and self._restore:
            gc.enable()
        self._lock = threading.Lock()
        self._holders, self._restore = 0, False
        self._generation += 1


_SWITCH = _Switch()


def hold_python_gc(owner: object) -> weakref.finalize[[], object]:
    """Turn automatic cyclic collection off until every holder has let go; ``owner`` holds it until the
    returned finalizer is called (once; later calls do nothing) or ``owner`` is garbage collected."""
    return weakref.finalize(owner, _SWITCH.hold())
