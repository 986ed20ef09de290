"""``deepspeed.ops``: the optimizers DeepSpeed compiles, as zeroshard's own (see zeroshard.optimizers)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.ops import adagrad, adam, lamb, lion, op_builder
from zeroshard.deepspeed.ops.op_builder import __compatible_ops__

__all__ = ["__compatible_ops__", "adagrad", "adam", "lamb", "lion", "op_builder"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
