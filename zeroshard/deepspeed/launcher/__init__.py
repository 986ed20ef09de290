"""``deepspeed.launcher``: the names integrations import from DeepSpeed's launcher (see ``runner``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.launcher import runner

__all__ = ["runner"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
