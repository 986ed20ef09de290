"""``deepspeed.utils.module_utils``: reach or replace a submodule (or any attribute) by its dotted name."""

from __future__ import annotations

from typing import Any

from zeroshard.deepspeed import surface

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``module_name="a.b.c"``: ``getattr`` one name at a time.

    Names are split on ``.`` only, so a ``Sequential``'s children are reached by their index
    (``"layers.0.attn"``) as ``named_modules()`` spells them. A missing name raises ``AttributeError``.
    """
    target = model
    for name in module_name.split("."):
        target = getattr(target, name)
    return target


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"`` (the parent is found with
    :func:`recursive_getattr`; ``nn.Module.__setattr__`` then registers a module or parameter as usual)."""
    parent, _, last = module_name.rpartition(".")
    owner = recursive_getattr(model, parent) if parent else model
    setattr(owner, last, module)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
