"""``deepspeed.accelerator.cuda_accelerator``: ``CUDA_Accelerator``."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.accelerator.real_accelerator import CUDA_Accelerator

__all__ = ["CUDA_Accelerator"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
