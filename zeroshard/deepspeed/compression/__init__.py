"""``deepspeed.compression``: only ``helper``'s two module helpers remain (as in DeepSpeed 0.19, whose
compression library is gone); import them from ``deepspeed.utils.module_utils``."""

from __future__ import annotations
