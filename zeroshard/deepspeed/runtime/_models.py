"""DeepSpeed's conventions for its config models, over zeroshard's config blocks.

DeepSpeed's config classes (``DeepSpeedZeroConfig``, ``DeepSpeedBF16Config``, the offload blocks, ...) are
pydantic models built with ``Model(strict=False, **keys)``: unless ``strict``, a key given as ``"auto"``
counts as not given (Hugging Face writes ``"auto"`` for values it fills in later), and fields can be
assigned, validated. zeroshard's blocks (``zeroshard.config.blocks``) have the same fields, defaults and
value checks, frozen; :class:`DeepSpeedModel` gives a block DeepSpeed's constructor and assignment.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict

__all__ = ["MUTABLE", "DeepSpeedModel", "lenient"]

MUTABLE = ConfigDict(frozen=False, validate_assignment=True)
"""Each subclass sets ``model_config = MUTABLE``: pydantic takes a later base's config over a mixin's."""


def lenient(strict: bool, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys given as ``"auto"``, unless ``strict``."""
    return data if strict else {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}


class DeepSpeedModel:
    """Mixin before a zeroshard block: ``cls(strict=False, **keys)``; with ``model_config = MUTABLE`` in the
    subclass, validated assignment."""

    def __init__(self, strict: bool = False, **data: Any) -> None:
        super().__init__(**lenient(strict, data))
