"""``deepspeed.profiling.flops_profiler``: the names import (LLaMA-Factory's FLOPs script imports
``get_model_profile``); calling one raises, naming the feature. ``torch.utils.flop_counter`` counts FLOPs."""

from __future__ import annotations

from typing import Any, NoReturn

from zeroshard.deepspeed.outofscope import unsupported, unsupported_class

__all__ = ["FlopsProfiler", "get_model_profile"]

_FEATURE = "DeepSpeed's FLOPs profiler (use torch.utils.flop_counter.FlopCounterMode)"
FlopsProfiler = unsupported_class("FlopsProfiler", _FEATURE)


def get_model_profile(*args: Any, **kwargs: Any) -> NoReturn:
    unsupported(f"{_FEATURE}: get_model_profile")
