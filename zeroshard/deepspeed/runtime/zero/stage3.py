"""``deepspeed.runtime.zero.stage3``: ``unwrap_model_for_generation``; DeepSpeed's ZeRO-3 optimizer classes
are refused at use (zeroshard's engine does their work)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zeroshard.deepspeed import surface

__all__ = ["unwrap_model_for_generation"]


@contextmanager
def unwrap_model_for_generation(model: Any) -> Iterator[Any]:
    """Yield the engine ``model`` with every parameter gathered, for generation: at ZeRO stage 3 one
    all-gather per unit on entry and no communication while the block runs (``model.generate`` runs as on
    one process), the parameters re-partitioned on exit (``engine.gathered_parameters()``); at stages 0-2
    it changes nothing. Training after the block is the same as without it. Collective: enter on all ranks.

    Raises:
        TypeError: ``model`` is not an engine ``deepspeed.initialize`` returned.
    """
    gathered = getattr(model, "gathered_parameters", None)
    if gathered is None:
        raise TypeError(
            f"unwrap_model_for_generation(model): expected the engine deepspeed.initialize returned, got "
            f"{type(model).__name__}"
        )
    with gathered():
        yield model


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
