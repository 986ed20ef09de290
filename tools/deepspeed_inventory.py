"""Write the inventory of DeepSpeed's public surface that ``zeroshard.deepspeed`` follows.

Run it with the DeepSpeed release to follow installed (the ``dev`` extra pins it)::

    make deepspeed-inventory            # = DS_ACCELERATOR=cpu .venv/bin/python tools/deepspeed_inventory.py

It imports every public module under ``deepspeed`` (modules and packages whose dotted path has no part
starting with ``_``), except the subtrees listed in ``OUT_OF_SCOPE`` below with their reasons, and records
for each module every public name it defines:

- classes and functions whose ``__module__`` is inside ``deepspeed`` (defined there or re-exported from
  another DeepSpeed module), with their signature (parameter names, kinds and defaults as ``repr``); for a
  class, the signature of its constructor, its base classes, its public methods with their signatures and,
  for an ``Enum``, its members;
- constants: values built of ``None``, ``bool``, ``int``, ``float``, ``str`` and lists, tuples and dicts of
  them (kept as values; a path into DeepSpeed's package, relative to it), and ``torch.dtype`` values;
- any other object (a logger, a module-level instance), by its type;
- in a package, another DeepSpeed module bound under a name that is not its own (``deepspeed.checkpointing``);
- names listed in the module's ``__all__``, whatever they are.

Modules that do not import in this environment even in DeepSpeed are recorded under ``unimportable`` with
the error. ``out_of_scope`` maps each left-out prefix (a trailing ``.``: the submodules only) to its
reason; ``zeroshard.deepspeed`` still imports every module under them and refuses their names at use.

The output is ``zeroshard/deepspeed/inventory.json``: ``zeroshard/deepspeed/surface.py`` reads it to
provide every listed name, and ``tests/test_deepspeed_surface.py`` checks the tree against it.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "zeroshard" / "deepspeed" / "inventory.json"

# Subtrees left out of the inventory: compiled-kernel and inference internals that no training script
# imports, and whose names would only ever be refused. Everything else is in the inventory, even features
# zeroshard refuses at use (pipeline, MoE, sequence parallelism), since scripts import far more than they use.
OUT_OF_SCOPE: dict[str, str] = {
    "deepspeed.inference": "inference engines (v1 and v2) and their CUDA kernels",
    "deepspeed.model_implementations": "inference model implementations over DeepSpeed's CUDA kernels",
    "deepspeed.module_inject": "kernel injection and automatic tensor parallelism for inference",
    "deepspeed.linear": "quantized and LoRA-optimized linear layers built on DeepSpeed's CUDA kernels",
    "deepspeed.ops.transformer": "fused transformer-layer CUDA kernels",
    "deepspeed.ops.triton_ops": "Triton kernels",
    "deepspeed.ops.fp_quantizer": "FP quantizer CUDA kernels",
    "deepspeed.ops.deepspeed4science": "DeepSpeed4Science Evoformer CUDA kernels",
    "deepspeed.ops.random_ltd": "random-LTD CUDA kernels",
    "deepspeed.ops.sparse_attention": "sparse attention Triton kernels",
    "deepspeed.ops.quantizer": "quantization CUDA kernels",
    "deepspeed.ops.transformer_inference": "inference CUDA kernels",
    "deepspeed.ops.gds": "GPUDirect Storage kernels",
    "deepspeed.ops.aio": "DeepSpeed's compiled async I/O op (zeroshard's NVMe offload is pure Python)",
    "deepspeed.ops.csrc": "kernel sources",
    "deepspeed.ops.op_builder.": (
        "the builders of DeepSpeed's compiled ops, one module each (zeroshard compiles none; "
        "deepspeed.ops.op_builder itself answers for all of them)"
    ),
    "deepspeed.compile": "DeepCompile's compiler passes and custom ops (torch.compile internals)",
    "deepspeed.git_version_info_installed": "build record written by DeepSpeed's setup.py",
    "deepspeed.runtime.zero.test": "a test script shipped inside the package",
    "deepspeed.nvme.validate_async_io": "a script that checks DeepSpeed's compiled async I/O op at import",
}
# Accelerator back-ends other than CPU and CUDA: each is a module of one class for hardware zeroshard does
# not run on.
OTHER_ACCELERATORS = "deepspeed.accelerator.", "_accelerator"
KEPT_ACCELERATORS = ("cpu", "cuda", "abstract", "real")

_PLAIN = (type(None), bool, int, float, str)
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _scoped_out(module: str) -> str | None:
    for prefix, reason in OUT_OF_SCOPE.items():
        if prefix.endswith(".") and module.startswith(prefix):  # the submodules, not the package itself
            return reason
        if module == prefix or module.startswith(prefix + "."):
            return reason
    head, tail = OTHER_ACCELERATORS
    if module.startswith(head) and module.endswith(tail):
        backend = module[len(head) : -len(tail)]
        if backend not in KEPT_ACCELERATORS:
            return f"the {backend} accelerator back-end (zeroshard runs on CPU and CUDA)"
    return None


def _plain_value(value: Any, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(value, _PLAIN) and not isinstance(value, enum.Enum):
        return not (isinstance(value, float) and value != value)  # NaN does not round-trip JSON equality
    if isinstance(value, (list, tuple)):
        return len(value) <= 256 and all(_plain_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= 256 and all(
            isinstance(k, str) and _plain_value(v, depth + 1) for k, v in value.items()
        )
    return False


def _signature(obj: Any) -> list[list[Any]] | None:
    """``[[name, kind, default_repr_or_None], ...]``, or ``None`` when Python cannot tell the signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = []
    for p in sig.parameters.values():
        # An object's repr carries its address: keep the rest, so the inventory is the same every run.
        default = None if p.default is inspect.Parameter.empty else _ADDRESS.sub("", repr(p.default))
        params.append([p.name, p.kind.name, default])
    return params


def _is_deepspeed(obj: Any) -> bool:
    return str(getattr(obj, "__module__", "") or "").split(".")[0] == "deepspeed"


def _describe_class(cls: type) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": "class", "defined_in": cls.__module__, "qualname": cls.__qualname__}
    entry["bases"] = [f"{b.__module__}.{b.__qualname__}" for b in cls.__bases__]
    if issubclass(cls, enum.Enum):
        entry["kind"] = "enum"
        entry["members"] = {m.name: m.value for m in cls if _plain_value(m.value)}
        return entry
    if issubclass(cls, BaseException):
        entry["kind"] = "exception"
    init = cls.__dict__.get("__init__") or cls.__dict__.get("__new__")
    entry["signature"] = _signature(cls) if init is not None or cls.__init__ is not object.__init__ else None
    methods = {}
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if inspect.isfunction(func):
            methods[name] = _signature(func)
        elif isinstance(member, property):
            methods[name] = "property"
    entry["methods"] = methods
    return entry


def _describe(name: str, value: Any, listed: bool, owner: Any) -> dict[str, Any] | None:
    if inspect.ismodule(value):
        # A package's DeepSpeed module under another name (``deepspeed.checkpointing``); submodules are
        # modules of their own in the inventory, and a plain module's ``import deepspeed.comm as dist`` is
        # its own business.
        inside = value.__name__.split(".")[0] == "deepspeed" and hasattr(owner, "__path__")
        if inside and value.__name__ != f"{owner.__name__}.{name}" and not _scoped_out(value.__name__):
            return {"kind": "module", "target": value.__name__}
        return None
    if inspect.isclass(value):
        if not (_is_deepspeed(value) or listed):
            return None
        return _describe_class(value)
    if callable(value) and (
        inspect.isfunction(value) or inspect.isbuiltin(value) or hasattr(value, "__wrapped__")
    ):
        if not (_is_deepspeed(value) or listed):
            return None
        entry = {"kind": "function", "defined_in": value.__module__, "signature": _signature(value)}
        return {**entry, "qualname": getattr(value, "__qualname__", name)}
    if _plain_value(value):
        home = os.path.dirname(importlib.import_module("deepspeed").__file__ or "") + os.sep
        if isinstance(value, str) and value.startswith(home):
            # A file of DeepSpeed's package (autotuning's templates): kept relative to the package, so the
            # inventory does not depend on where DeepSpeed is installed.
            return {"kind": "package_path", "value": value[len(home) :]}
        if isinstance(value, tuple):
            return {"kind": "constant", "value": list(value), "type": "tuple"}
        return {"kind": "constant", "value": value}
    import torch

    if isinstance(value, torch.dtype):
        return {"kind": "dtype", "value": str(value)}
    if isinstance(value, enum.Enum) and _is_deepspeed(type(value)):
        return {
            "kind": "enum_member",
            "type": f"{type(value).__module__}.{type(value).__qualname__}",
            "member": value.name,
        }
    if not (_is_deepspeed(type(value)) or listed):
        return None
    return {"kind": "object", "type": f"{type(value).__module__}.{type(value).__qualname__}"}


def _module_entry(module: Any) -> dict[str, Any]:
    listed = set(getattr(module, "__all__", ()) or ())
    names: dict[str, Any] = {}
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        entry = _describe(name, getattr(module, name), name in listed, module)
        if entry is not None:
            names[name] = entry
    return {"package": hasattr(module, "__path__"), "all": sorted(listed) or None, "names": names}


def _walk(package: Any) -> tuple[list[str], dict[str, str]]:
    """The public modules to record, and the accelerator back-ends left out (each named with its reason,
    since no prefix of ``OUT_OF_SCOPE`` covers them)."""
    found = [package.__name__]
    backends: dict[str, str] = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=lambda _: None):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts):
            continue
        reason = _scoped_out(info.name)
        if reason is None:
            found.append(info.name)
        elif not any(info.name == p or info.name.startswith(p) for p in OUT_OF_SCOPE):
            backends[info.name] = reason
    return sorted(set(found)), dict(sorted(backends.items()))


def build() -> dict[str, Any]:
    warnings.simplefilter("ignore")
    import deepspeed

    modules: dict[str, Any] = {}
    unimportable: dict[str, str] = {}
    names, backends = _walk(deepspeed)
    for name in names:
        try:
            module = importlib.import_module(name)
        except BaseException as error:  # a module may raise anything (SystemExit, OSError) when imported
            unimportable[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            continue
        modules[name] = _module_entry(module)
    return {
        "deepspeed_version": deepspeed.__version__,
        "generated_by": "tools/deepspeed_inventory.py",
        "out_of_scope": {**OUT_OF_SCOPE, **backends},
        "unimportable": unimportable,
        "modules": modules,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    if os.environ.get("ZEROSHARD_AS_DEEPSPEED") == "1":
        sys.exit("unset ZEROSHARD_AS_DEEPSPEED: the inventory is read off the real DeepSpeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    inventory = build()
    # One module per line: a new DeepSpeed release shows as a readable diff.
    lines = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in inventory["modules"].items()]
    head = {k: v for k, v in inventory.items() if k != "modules"}
    text = (
        json.dumps(head, indent=1, sort_keys=True)[:-2]
        + ',\n "modules": {\n'
        + ",\n".join(lines)
        + "\n }\n}\n"
    )
    json.loads(text)  # the hand-joined text is valid JSON
    args.output.write_text(text)
    count = sum(len(m["names"]) for m in inventory["modules"].values())
    print(
        f"{args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}: DeepSpeed "
        f"{inventory['deepspeed_version']}, {len(inventory['modules'])} modules, {count} names, "
        f"{len(inventory['unimportable'])} unimportable, {len(OUT_OF_SCOPE)} subtrees out of scope"
    )


if __name__ == "__main__":
    main()
