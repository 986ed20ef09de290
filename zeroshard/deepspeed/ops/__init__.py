"""``deepspeed.ops``: the optimizers DeepSpeed compiles, as zeroshard's own (see zeroshard.optimizers)."""

from __future__ import annotations

from zeroshard.deepspeed.ops import adagrad, adam, lamb, lion

__all__ = ["adagrad", "adam", "lamb", "lion"]
