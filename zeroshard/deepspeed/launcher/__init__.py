"""``deepspeed.launcher``: the names integrations import from DeepSpeed's launcher (see ``runner``)."""

from __future__ import annotations

from zeroshard.deepspeed.launcher import runner

__all__ = ["runner"]
