"""``deepspeed.runtime.sequence_parallel``: sequence parallelism is out of zeroshard's scope (names import,
use raises)."""

from __future__ import annotations

from zeroshard.deepspeed.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
