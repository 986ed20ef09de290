"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` (also ``deepspeed.checkpointing``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]

__getattr__ = surface.fallback(__name__)
