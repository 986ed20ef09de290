"""``deepspeed.runtime``: the engine, config, LR schedules, ZeRO names and optimizer base classes."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime import base_optimizer, lr_schedules, zero
from zeroshard.runtime.engine import ZeroshardEngine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "base_optimizer", "lr_schedules", "zero"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
