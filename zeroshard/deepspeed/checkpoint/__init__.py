"""``deepspeed.checkpoint``: helpers for saving tensors (checkpoints: zeroshard.checkpoint)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.checkpoint import utils

__all__ = ["utils"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
