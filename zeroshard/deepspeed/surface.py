"""The rest of DeepSpeed's public surface, provided from the inventory (``inventory.json``).

[Note: generated surface]
``inventory.json`` (written by ``tools/deepspeed_inventory.py`` from an installed DeepSpeed) lists every
public module of DeepSpeed and every public name each defines. ``zeroshard.deepspeed`` provides all of them:

- A module written by hand in this tree (``runtime/zero/partition_parameters.py``, ``utils/__init__.py``,
  ...) is imported as usual and its names are zeroshard's implementation. It ends with
  ``__getattr__ = surface.fallback(__name__)``, so a DeepSpeed name it does not define comes from here.
- A DeepSpeed module with no file here is made by :class:`SurfaceFinder` (appended to ``sys.meta_path``,
  so files always win): an empty module whose ``__getattr__`` is the same fallback.
- A module of a subtree left out of the inventory (``out_of_scope`` in it: inference kernels, compiled
  ops) imports too, at any depth; every public name of it is a refused class.

The fallback builds a name on first access, by its kind in the inventory, and caches it in the module:

- a name DeepSpeed re-exports from another of its modules is taken from that module here (so
  ``deepspeed.X.Foo is deepspeed.Y.Foo`` holds as in DeepSpeed, and a hand-written ``Foo`` serves both);
- constants, ``torch.dtype`` values and enums are DeepSpeed's own values (config keys, defaults, states);
- exception classes are real exception classes, so ``except deepspeed.X.SomeError`` works;
- any other class, function or object is *refused at use*: importing it works, calling or constructing it
  checks the arguments against DeepSpeed's signature (a wrong call raises ``TypeError`` as in DeepSpeed),
  then raises ``NotImplementedError`` naming the name, the feature it belongs to and the docs section
  (``refusals.py``).

Every object made here carries ``__zeroshard_surface__``: ``"data"`` for reproduced values and exception
classes, ``"refused"`` for the rest; hand-written accepted no-ops carry ``"accepted"``
(:func:`accepted`). ``tools/deepspeed_surface_report.py`` counts the three classes for docs/porting.md.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from zeroshard.deepspeed.refusals import (
    MARK,
    RefusedObject,
    feature_of,
    refused_class,
    refused_function,
    refusing_getattr,
)

__all__ = [
    "PACKAGE",
    "SurfaceFinder",
    "accepted",
    "deepspeed_name",
    "fallback",
    "feature_of",
    "install",
    "inventory",
    "kind_of",
    "our_name",
    "scoped_out",
]

PACKAGE = "zeroshard.deepspeed"
INVENTORY = Path(__file__).with_name("inventory.json")

_F = TypeVar("_F", bound=Callable[..., Any])


@functools.cache
def inventory() -> dict[str, Any]:
    """The inventory of DeepSpeed's public surface (read once, on first use)."""
    with INVENTORY.open() as f:
        return json.load(f)  # type: ignore[no-any-return]


def deepspeed_name(module: str) -> str:
    """``zeroshard.deepspeed.X`` -> ``deepspeed.X``."""
    if module == PACKAGE or module.startswith(PACKAGE + "."):
        return "deepspeed" + module[len(PACKAGE) :]
    return module


def our_name(module: str) -> str:
    """``deepspeed.X`` -> ``zeroshard.deepspeed.X``."""
    return PACKAGE + module[len("deepspeed") :]


def kind_of(obj: Any) -> str:
    """``"refused"``, ``"accepted"`` or ``"data"`` for objects made or marked here, else ``"implemented"``."""
    try:
        mark = inspect.getattr_static(obj, MARK)
    except AttributeError:
        return "implemented"
    return mark if isinstance(mark, str) else "implemented"


def accepted(reason: str) -> Callable[[_F], _F]:
    """Mark a hand-written function or class as an accepted no-op: what DeepSpeed does on this hardware is
    nothing (or only records), and zeroshard does the same. ``reason`` says why, for the docs."""

    def mark(obj: _F) -> _F:
        setattr(obj, MARK, "accepted")
        obj.__zeroshard_reason__ = reason  # type: ignore[attr-defined]
        return obj

    return mark


def _exception(module: str, name: str, entry: dict[str, Any]) -> type:
    bases = tuple(_builtin_exception(b) for b in entry.get("bases", ())) or (Exception,)
    namespace = {
        "__module__": module,
        MARK: "data",
        "__doc__": f"DeepSpeed's ``{deepspeed_name(module)}.{name}``.",
    }
    return type(name, bases, namespace)


def _builtin_exception(qualified: str) -> type:
    module, _, attr = qualified.rpartition(".")
    if module == "builtins":
        found = getattr(__import__("builtins"), attr, Exception)
        return found if isinstance(found, type) and issubclass(found, BaseException) else Exception
    if module.startswith("deepspeed."):
        found = _resolve(module, attr)
        if isinstance(found, type) and issubclass(found, BaseException):
            return found
    return Exception


def _enum(module: str, name: str, entry: dict[str, Any]) -> type:
    members = entry.get("members") or {}
    made = enum.Enum(name, {k: (tuple(v) if isinstance(v, list) else v) for k, v in members.items()})  # type: ignore[misc]
    made.__module__ = module
    setattr(made, MARK, "data")
    return made


def _dtype(text: str) -> Any:
    import torch

    return getattr(torch, text.removeprefix("torch."))


def _resolve(ds_module: str, name: str) -> Any:
    """Name ``name`` of DeepSpeed module ``ds_module`` in this tree (hand-written or made here)."""
    return getattr(importlib.import_module(our_name(ds_module)), name)


@functools.cache
def _exporters() -> dict[tuple[str, str], tuple[str, ...]]:
    """``(defining module, name) -> the modules that list it``, for the classes and functions of the
    inventory (a name is listed by the module that defines it and by those that re-export it)."""
    found: dict[tuple[str, str], list[str]] = {}
    for ds_module, entry in inventory()["modules"].items():
        for name, item in entry["names"].items():
            if item.get("defined_in") and item.get("qualname") == name:
                found.setdefault((item["defined_in"], name), []).append(ds_module)
    return {key: tuple(modules) for key, modules in found.items()}


def _written_here(ds_module: str, name: str) -> Any:
    """Name ``name`` as a module written in this tree defines it, or ``None`` (made modules, made names)."""
    module = importlib.import_module(our_name(ds_module))
    value = None if getattr(module, MARK, None) == "generated" else vars(module).get(name)
    if value is None or inspect.ismodule(value) or kind_of(value) == "refused":
        return None  # a submodule bound under a name its parent also defines (``utils.tensor_fragment``)
    return value


def _make(module: str, name: str, entry: dict[str, Any]) -> Any:
    kind = entry["kind"]
    ds_module = deepspeed_name(module)
    defined_in, qualname = entry.get("defined_in"), entry.get("qualname", name)
    if defined_in and qualname == name:
        # One object under every name DeepSpeed gives it: a hand-written one wherever it is written (the
        # defining module first), else the one the defining module makes.
        exporters = _exporters().get((defined_in, name), ())
        for other in sorted(exporters, key=lambda m: m != defined_in):
            written = _written_here(other, name) if other != ds_module else None
            if written is not None:
                return written
        if defined_in != ds_module and defined_in in inventory()["modules"]:
            return _resolve(defined_in, name)
    if kind == "module":
        return importlib.import_module(our_name(entry["target"]))
    if kind == "package_path":  # the same file's place in this package (deepspeed.__file__'s directory)
        return str(Path(__file__).parent / entry["value"])
    if kind == "constant":
        value = entry["value"]
        return tuple(value) if entry.get("type") == "tuple" else value
    if kind == "dtype":
        return _dtype(entry["value"])
    if kind == "enum":
        return _enum(module, name, entry)
    if kind == "enum_member":
        enum_module, _, enum_name = entry["type"].rpartition(".")
        return getattr(_resolve(enum_module, enum_name), entry["member"])
    if kind == "exception":
        return _exception(module, name, entry)
    if kind == "class":
        return refused_class(module, ds_module, name, entry, scoped_out(defined_in or ds_module))
    if kind == "function":
        return refused_function(module, ds_module, name, entry, scoped_out(defined_in or ds_module))
    return RefusedObject(f"{ds_module}.{name}", feature_of(ds_module))


def scoped_out(ds_module: str) -> str | None:
    """Why DeepSpeed module ``ds_module`` is left out of the inventory, or ``None`` when it is not."""
    for prefix, reason in inventory()["out_of_scope"].items():
        if prefix.endswith(".") and ds_module.startswith(prefix):  # the submodules, not the package
            return str(reason)
        if ds_module == prefix or ds_module.startswith(prefix + "."):
            return str(reason)
    return None


def fallback(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` (``zeroshard.deepspeed.X``) that provides the DeepSpeed names
    it does not define (see [Note: generated surface]); the made object is cached in the module."""
    ds_module = deepspeed_name(module)

    def __getattr__(name: str) -> Any:
        modules = inventory()["modules"]
        entry = modules.get(ds_module, {}).get("names", {}).get(name)
        if entry is not None:
            value = _make(module, name, entry)
        elif f"{ds_module}.{name}" in modules or scoped_out(f"{ds_module}.{name}"):
            value = importlib.import_module(f"{module}.{name}")
        else:
            raise AttributeError(f"module {ds_module!r} ({module}) has no attribute {name!r}")
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__


# --- modules with no file here ----------------------------------------------------------------------------


class _SurfaceLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        ds_module = deepspeed_name(module.__name__)
        entry = inventory()["modules"][ds_module]
        module.__doc__ = (
            f"DeepSpeed's ``{ds_module}``, provided from the inventory: see [Note: generated surface] in "
            f"{__name__}."
        )
        if entry.get("all"):
            module.__all__ = list(entry["all"])  # type: ignore[attr-defined]
        module.__getattr__ = fallback(module.__name__)  # type: ignore[method-assign]
        setattr(module, MARK, "generated")


class _LeftOutLoader(importlib.abc.Loader):
    """A module of a subtree left out of the inventory (inference kernels, ...): it imports, and each of
    its names is refused at use (the inventory does not know them, so they are all refused classes)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        ds_module = deepspeed_name(module.__name__)
        module.__doc__ = f"DeepSpeed's ``{ds_module}``, left out of zeroshard: {self.reason}."
        module.__getattr__ = refusing_getattr(module.__name__, ds_module, self.reason)  # type: ignore[method-assign]
        setattr(module, MARK, "left out")


class SurfaceFinder(importlib.abc.MetaPathFinder):
    """Makes ``zeroshard.deepspeed.X`` for a DeepSpeed module ``deepspeed.X`` with no file in this tree."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        ds_module = deepspeed_name(fullname)
        entry = inventory()["modules"].get(ds_module)
        if entry is not None:
            return importlib.util.spec_from_loader(
                fullname, _SurfaceLoader(), is_package=bool(entry["package"])
            )
        reason = scoped_out(ds_module)
        if reason is None:
            return None
        return importlib.util.spec_from_loader(fullname, _LeftOutLoader(reason), is_package=True)


def install() -> None:
    """Append :class:`SurfaceFinder` to ``sys.meta_path`` (idempotent): after the path finder, so a module
    written here always wins over a made one."""
    if not any(isinstance(f, SurfaceFinder) for f in sys.meta_path):
        sys.meta_path.append(SurfaceFinder())
