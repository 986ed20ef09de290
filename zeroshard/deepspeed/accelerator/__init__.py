"""``deepspeed.accelerator``: ``get_accelerator()`` over torch's CUDA and CPU back-ends."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.accelerator.real_accelerator import (
    CPU_Accelerator,
    CUDA_Accelerator,
    DeepSpeedAccelerator,
    get_accelerator,
    set_accelerator,
)

__all__ = [
    "CPU_Accelerator",
    "CUDA_Accelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "set_accelerator",
]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
