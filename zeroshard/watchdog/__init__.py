"""Failure diagnostics: telling a dead peer from a slow one, and naming what every rank was doing when a
collective fails ([Note: liveness] in ``monitor.py``).

- ``monitor``: ``LivenessMonitor``, the records a ``Comm`` reports its collectives and waits to, and the
  ``CollectiveError`` a failed wait raises.
- ``verdicts``: reading the peers' published states: why a wait cannot complete, the last-collectives table.
- ``heartbeat``: rank 0's store and a thread per process; ``start``, ``halt_all``, ``stop_all`` and
  ``monitor_for_world`` (the monitor ``initialize`` and ``zero.Init`` hand to their ``Comm``).

``zeroshard.core`` does not import this package: it knows the monitor as the ``Monitor`` protocol of
``zeroshard/core/liveness.py``.
"""

from __future__ import annotations

from zeroshard.watchdog.heartbeat import halt_all, monitor_for_world, start, stop_all
from zeroshard.watchdog.monitor import LivenessMonitor

__all__ = ["LivenessMonitor", "halt_all", "monitor_for_world", "start", "stop_all"]
