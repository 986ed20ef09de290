"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: what accelerate and transformers import for
``ParallelismConfig(sp_backend="deepspeed")``; zeroshard is data parallel only, so using them (accelerate
calls ``UlyssesSPAttentionHF.register_with_transformers``) raises an error naming the feature."""

from __future__ import annotations

from typing import Any, NoReturn

from zeroshard.deepspeed.outofscope import unsupported, unsupported_class

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"]

_FEATURE = "Ulysses sequence parallelism (deepspeed.runtime.sequence_parallel)"


class UlyssesSPAttentionHF:
    """Not supported by zeroshard: Ulysses sequence parallelism."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unsupported(f"{_FEATURE} (UlyssesSPAttentionHF)")

    @staticmethod
    def register_with_transformers(*args: Any, **kwargs: Any) -> NoReturn:
        unsupported(f"{_FEATURE} (UlyssesSPAttentionHF.register_with_transformers)")


UlyssesSPDataLoaderAdapter = unsupported_class("UlyssesSPDataLoaderAdapter", _FEATURE)
