"""``deepspeed.compression``: only ``helper``'s two module helpers remain (as in DeepSpeed 0.19, whose
compression library is gone); import them from ``deepspeed.utils.module_utils``."""

from __future__ import annotations

from zeroshard.deepspeed import surface

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
