"""``deepspeed.utils.timer``: ``ThroughputTimer`` is zeroshard's (``zeroshard/telemetry/throughput.py``), the
timer ``engine.tput_timer`` is, with DeepSpeed's constructor and fields."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.telemetry.throughput import ThroughputTimer

__all__ = ["ThroughputTimer"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
