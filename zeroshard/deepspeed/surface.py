"""The rest of DeepSpeed's public surface, provided from the inventory (``inventory.json``).

[Note: generated surface]
``inventory.json`` (written by ``tools/deepspeed_inventory.py`` from an installed DeepSpeed) lists every
public module of DeepSpeed and every public name each defines. ``zeroshard.deepspeed`` provides all of them:

- A module written by hand in this tree (``runtime/zero/partition_parameters.py``, ``utils/__init__.py``,
  ...) is imported as usual and its names are zeroshard's implementation. It ends with
  ``__getattr__ = surface.fallback(__name__)``, so a DeepSpeed name it does not define comes from here.
- A DeepSpeed module with no file here is made by :class:`SurfaceFinder` (appended to ``sys.meta_path``,
  so files always win): an empty module whose ``__getattr__`` is the same fallback.

The fallback builds a name on first access, by its kind in the inventory, and caches it in the module:

- a name DeepSpeed re-exports from another of its modules is taken from that module here (so
  ``deepspeed.X.Foo is deepspeed.Y.Foo`` holds as in DeepSpeed, and a hand-written ``Foo`` serves both);
- constants, ``torch.dtype`` values and enums are DeepSpeed's own values (config keys, defaults, states);
- exception classes are real exception classes, so ``except deepspeed.X.SomeError`` works;
- any other class, function or object is *refused at use*: importing it works, calling or constructing it
  checks the arguments against DeepSpeed's signature (a wrong call raises ``TypeError`` as in DeepSpeed),
  then raises ``NotImplementedError`` naming the name, the feature it belongs to and the docs section.

Every object made here carries ``__zeroshard_surface__``: ``"data"`` for reproduced values and exception
classes, ``"refused"`` for the rest; hand-written accepted no-ops carry ``"accepted"``
(:func:`accepted`). ``tools/deepspeed_surface_report.py`` counts the three classes for docs/porting.md.
"""

from __future__ import annotations

import ast
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
from typing import Any, NoReturn, TypeVar

__all__ = [
    "DOCS",
    "PACKAGE",
    "SurfaceFinder",
    "accepted",
    "fallback",
    "feature_of",
    "install",
    "inventory",
    "kind_of",
]

PACKAGE = "zeroshard.deepspeed"
INVENTORY = Path(__file__).with_name("inventory.json")
DOCS = "docs/porting.md#refused-at-use"
MARK = "__zeroshard_surface__"

# The feature a refused name belongs to, by DeepSpeed module prefix (the longest prefix wins).
FEATURES: dict[str, str] = {
    "deepspeed.pipe": "pipeline parallelism",
    "deepspeed.runtime.pipe": "pipeline parallelism",
    "deepspeed.moe": "mixture of experts",
    "deepspeed.sequence": "sequence parallelism (Ulysses, FPDT)",
    "deepspeed.runtime.sequence_parallel": "sequence parallelism (Ulysses)",
    "deepspeed.runtime.tensor_parallel": "tensor parallelism (AutoTP)",
    "deepspeed.runtime.domino": "Domino tensor-parallel overlap",
    "deepspeed.runtime.hybrid_engine": "the RLHF hybrid engine (inference kernels)",
    "deepspeed.runtime.hybrid_engine_graph": "the RLHF hybrid engine (inference kernels)",
    "deepspeed.runtime.rollout": "RLHF rollout engines",
    "deepspeed.runtime.zenflow": "ZenFlow",
    "deepspeed.runtime.superoffload": "SuperOffload",
    "deepspeed.runtime.data_pipeline": "data efficiency (curriculum learning, data sampling, random-LTD)",
    "deepspeed.runtime.swap_tensor": "DeepSpeed's NVMe swapper internals (zeroshard's offload replaces them)",
    "deepspeed.runtime.zero": "DeepSpeed's ZeRO internals (zeroshard's engine replaces them)",
    "deepspeed.runtime.fp16": "DeepSpeed's fp16 optimizer internals (zeroshard's engine replaces them)",
    "deepspeed.runtime.comm": "compressed communication (1-bit optimizers)",
    "deepspeed.runtime.checkpoint_engine": "DeepSpeed's checkpoint engines (Nebula, FastPersist, decoupled)",
    "deepspeed.runtime.model_checkpointing": "DeepSpeed's checkpoint writers (FastPersist)",
    "deepspeed.runtime": "DeepSpeed's runtime internals (zeroshard's engine replaces them)",
    "deepspeed.compression": "model compression (quantization-aware training, pruning)",
    "deepspeed.autotuning": "the autotuner",
    "deepspeed.profiling": (
        "DeepSpeed's FLOPs profiler (torch.utils.flop_counter.FlopCounterMode counts a model's FLOPs)"
    ),
    "deepspeed.monitor": "DeepSpeed's monitor classes (zeroshard reads the same config blocks)",
    "deepspeed.nvme": "DeepSpeed's NVMe benchmarking tools",
    "deepspeed.io": "DeepSpeed's FastPersist file writers",
    "deepspeed.datastates": "DataStates asynchronous checkpointing",
    "deepspeed.checkpoint": "DeepSpeed's universal-checkpoint tools",
    "deepspeed.launcher": "DeepSpeed's launcher internals (zeroshard launch runs scripts)",
    "deepspeed.elasticity": "DeepSpeed elasticity",
    "deepspeed.comm": "DeepSpeed's communication internals",
    "deepspeed.accelerator": "DeepSpeed's accelerator back-ends other than CPU and CUDA",
    "deepspeed.ops": "DeepSpeed's compiled ops",
    "deepspeed.utils": "DeepSpeed's utility internals",
    "deepspeed": "DeepSpeed internals",
}

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


def feature_of(ds_module: str) -> str:
    """The feature (a phrase for messages and docs) that DeepSpeed module ``ds_module`` belongs to."""
    parts = ds_module.split(".")
    for n in range(len(parts), 0, -1):
        feature = FEATURES.get(".".join(parts[:n]))
        if feature is not None:
            return feature
    return FEATURES["deepspeed"]


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


def refuse(what: str, feature: str) -> NoReturn:
    raise NotImplementedError(
        f"{what} belongs to {feature}, which zeroshard does not provide (zeroshard is ZeRO data "
        f"parallelism with DeepSpeed's API); see {DOCS}"
    )


# --- signatures -----------------------------------------------------------------------------------------


class _Default:
    """A default value the inventory only knows by its ``repr`` (an object, a function)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _default(text: str | None) -> Any:
    if text is None:
        return inspect.Parameter.empty
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _Default(text)
    return value if repr(value) == text else _Default(text)  # ``500,000,000`` is not a tuple


def signature_of(params: Sequence[Sequence[Any]] | None) -> inspect.Signature | None:
    """The :class:`inspect.Signature` an inventory entry describes (``None`` when DeepSpeed's is unknown)."""
    if params is None:
        return None
    return inspect.Signature(
        [
            inspect.Parameter(name, getattr(inspect.Parameter, kind), default=_default(default))
            for name, kind, default in params
        ]
    )


# --- the objects ------------------------------------------------------------------------------------------


def _refused_function(module: str, name: str, entry: dict[str, Any]) -> Callable[..., Any]:
    ds_module = deepspeed_name(module)
    sig = signature_of(entry.get("signature"))
    feature = feature_of(ds_module)

    def refused(*args: Any, **kwargs: Any) -> Any:
        if sig is not None:
            sig.bind(*args, **kwargs)  # a call DeepSpeed would reject fails the same way first
        refuse(f"{ds_module}.{name}()", feature)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"DeepSpeed's ``{ds_module}.{name}``: refused at use ({feature})."
    refused.__signature__ = sig  # type: ignore[attr-defined]
    setattr(refused, MARK, "refused")
    return refused


class _RefusedMeta(type):
    """Metaclass of refused classes: DeepSpeed's public methods read on the class itself are refused too."""

    def __getattr__(cls, attr: str) -> Any:
        methods = cls.__dict__.get("_deepspeed_methods", {})
        if attr in methods:
            refuse(f"{cls.__dict__['_deepspeed_name']}.{attr}", cls.__dict__["_deepspeed_feature"])
        raise AttributeError(attr)


def _refused_class(module: str, name: str, entry: dict[str, Any]) -> type:
    ds_module = deepspeed_name(module)
    feature = feature_of(ds_module)
    qualified = f"{ds_module}.{name}"

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if sig is not None:
            sig.bind(*args, **kwargs)
        refuse(qualified, feature)

    sig = signature_of(entry.get("signature"))
    namespace = {
        "__init__": __init__,
        "__module__": module,
        "__doc__": f"DeepSpeed's ``{qualified}``: refused at use ({feature}).",
        "__signature__": sig,
        MARK: "refused",
        "_deepspeed_name": qualified,
        "_deepspeed_feature": feature,
        "_deepspeed_methods": entry.get("methods") or {},
    }
    return _RefusedMeta(name, (), namespace)


class _RefusedObject:
    """A module-level DeepSpeed object (a timer, a logger instance) of a refused kind."""

    def __init__(self, qualified: str, feature: str) -> None:
        object.__setattr__(self, "_qualified", qualified)
        object.__setattr__(self, "_feature", feature)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        refuse(f"{self._qualified}.{attr}", self._feature)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        refuse(f"{self._qualified}()", self._feature)

    def __repr__(self) -> str:
        return f"<{self._qualified}: refused at use>"


_RefusedObject.__zeroshard_surface__ = "refused"  # type: ignore[attr-defined]


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
        return _refused_class(module, name, entry)
    if kind == "function":
        return _refused_function(module, name, entry)
    return _RefusedObject(f"{ds_module}.{name}", feature_of(ds_module))


def fallback(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module`` (``zeroshard.deepspeed.X``) that provides the DeepSpeed names
    it does not define (see [Note: generated surface]); the made object is cached in the module."""
    ds_module = deepspeed_name(module)

    def __getattr__(name: str) -> Any:
        modules = inventory()["modules"]
        entry = modules.get(ds_module, {}).get("names", {}).get(name)
        if entry is not None:
            value = _make(module, name, entry)
        elif f"{ds_module}.{name}" in modules:
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


class SurfaceFinder(importlib.abc.MetaPathFinder):
    """Makes ``zeroshard.deepspeed.X`` for a DeepSpeed module ``deepspeed.X`` with no file in this tree."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PACKAGE + "."):
            return None
        entry = inventory()["modules"].get(deepspeed_name(fullname))
        if entry is None:
            return None
        return importlib.util.spec_from_loader(fullname, _SurfaceLoader(), is_package=bool(entry["package"]))


def install() -> None:
    """Append :class:`SurfaceFinder` to ``sys.meta_path`` (idempotent): after the path finder, so a module
    written here always wins over a made one."""
    if not any(isinstance(f, SurfaceFinder) for f in sys.meta_path):
        sys.meta_path.append(SurfaceFinder())
