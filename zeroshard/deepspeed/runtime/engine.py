"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is :class:`zeroshard.ZeroshardEngine`."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.runtime.engine import ZeroshardEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
