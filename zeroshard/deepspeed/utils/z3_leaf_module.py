"""``deepspeed.utils.z3_leaf_module``: mark modules whose whole subtree ZeRO-3 gathers at once.

DeepSpeed's semantics: the functions mark the module *instances* present when they are called (a module
added later is not marked), by class (a class, its name or its qualified name) or by name in
``model.named_modules()``, and return what they marked. zeroshard keeps the mark in its own per-module record
(``zeroshard.core.stage3.module_marks``) and reads it when ``initialize`` builds the stage-3 units.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zeroshard.core.stage3.module_marks import is_leaf, set_leaf
from zeroshard.deepspeed import surface

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether ``model`` itself is marked a leaf."""
    return is_leaf(model)


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that are marked leaves."""
    return [m for m in model.modules() if is_leaf(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark or unmark ``model`` itself."""
    set_leaf(model, flag)


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag_classes(
    model: nn.Module, leaf_module_classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must hold classes or class names, got {bad!r}")
    marked = [m for m in model.modules() if any(_matches(m, c) for c in leaf_module_classes)]
    for module in marked:
        set_leaf(module, flag)
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of a class in {list(leaf_module_classes)!r} in {type(model).__name__}")
    return marked


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of ``model`` that is an instance of (or whose class is named by) one of
    ``leaf_module_classes``; a ``ValueError`` when none is and ``raise_if_not_found``. Returns them."""
    return _flag_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unmark the modules :func:`set_z3_leaf_modules` would mark; returns them."""
    return _flag_classes(model, leaf_module_classes, False, raise_if_not_found)


def _flag_named(
    model: nn.Module, keys: Sequence[str], flag: bool, raise_if_not_found: bool, by_suffix: bool
) -> tuple[list[nn.Module], list[str]]:
    named = dict(model.named_modules())
    marked: list[nn.Module] = []
    missing: list[str] = []
    for key in keys:
        hits = (
            [m for n, m in named.items() if n.endswith(key)]
            if by_suffix
            else [named[key]]
            if key in named
            else []
        )
        if not hits:
            missing.append(key)
        for module in hits:
            if all(module is not m for m in marked):
                set_leaf(module, flag)
                marked.append(module)
    if missing and raise_if_not_found:
        what = "name suffixes" if by_suffix else "names"
        raise ValueError(f"no modules with {what} {missing!r} in {type(model).__name__}")
    return marked, missing


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the mark to ``flag`` on the modules named in ``model.named_modules()``; returns the modules and
    the names that matched nothing (a ``ValueError`` instead when ``raise_if_not_found``)."""
    return _flag_named(model, module_names, flag, raise_if_not_found, by_suffix=False)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """As :func:`set_z3_leaf_modules_by_name`, for every module whose name ends with a suffix."""
    return _flag_named(model, module_name_suffixes, flag, raise_if_not_found, by_suffix=True)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
