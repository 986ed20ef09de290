"""``deepspeed.monitor.comet``: the Comet monitor is refused at use (zeroshard writes no Comet events)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.monitor.monitor import Monitor

__all__ = ["Monitor"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
