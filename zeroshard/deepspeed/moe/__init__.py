"""``deepspeed.moe``: mixture of experts is out of zeroshard's scope (names import, use raises)."""

from __future__ import annotations

from zeroshard.deepspeed import surface

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
