"""``deepspeed.utils.nvtx``: ``instrument_w_nvtx``, a decorator that marks each call as a profiler range.

The range goes through the accelerator, as DeepSpeed's does: on CUDA ``range_push`` / ``range_pop`` are
``torch.cuda.nvtx``'s, so the call shows in Nsight Systems under the function's qualified name; on the CPU
they do nothing and the decorated function runs as it is. Nothing is recorded while ``torch.compile``
traces (a range there would break the graph) or when ``enable_nvtx`` is set to ``False``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.accelerator import get_accelerator

__all__ = ["enable_nvtx", "instrument_w_nvtx"]

enable_nvtx = True
"""DeepSpeed's switch: set ``deepspeed.utils.nvtx.enable_nvtx = False`` to stop recording ranges."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def instrument_w_nvtx(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """``func``, with each call inside an accelerator range named ``func.__qualname__``.

    The range is closed when ``func`` returns or raises, so an exception leaves no range open.
    """

    @functools.wraps(func)
    def wrapped_fn(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if not enable_nvtx or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        accelerator.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            accelerator.range_pop()

    return wrapped_fn


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
