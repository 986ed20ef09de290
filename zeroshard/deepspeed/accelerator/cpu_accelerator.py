"""``deepspeed.accelerator.cpu_accelerator``: ``CPU_Accelerator``."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.accelerator.real_accelerator import CPU_Accelerator

__all__ = ["CPU_Accelerator"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
