"""``deepspeed.monitor.csv_monitor``: ``csvMonitor`` (see ``deepspeed.monitor.monitor``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.monitor.monitor import Monitor, csvMonitor

__all__ = ["Monitor", "csvMonitor"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
