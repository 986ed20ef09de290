"""The package's import graph has no cycles: every ``zeroshard`` import, at module level, under
``TYPE_CHECKING`` or inside a function, points one way (core below engine, engine below the entry points).

A cycle here is a design smell before it is a runtime error: a module that needs its importer should take
what it needs as an argument or a protocol (see ``checkpoint/state.py``, ``core/flat_param.ShardStore``).
"""

from __future__ import annotations

import ast
import importlib
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest

import zeroshard
from zeroshard.core.owners import OwnerRegistry

PACKAGE = Path(zeroshard.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a.b import c`` counts ``a.b.c`` if it is a module).

    Importing a submodule also runs its parents' ``__init__``; those implicit edges are not counted, or the
    package root (which re-exports the public API) would close a cycle with everything.
    """
    files = {_module_name(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                    for a in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None`` (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for root in sorted(graph):
        if root in state:
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_package_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert "zeroshard.core.flat_param" in graph and graph["zeroshard.engine"], "the walk found no imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_core_does_not_import_the_layers_above_it() -> None:
    """``zeroshard.core`` is the sharded step: it never reaches up into checkpoints, offload stores,
    the engine, the CLI or the DeepSpeed names (they hand it what it needs)."""
    above = (
        "zeroshard.engine",
        "zeroshard.build",
        "zeroshard.checkpoint",
        "zeroshard.offload",
        "zeroshard.cli",
    )
    graph = import_graph(PACKAGE)
    bad = {
        (name, t)
        for name, targets in graph.items()
        if name.startswith("zeroshard.core")
        for t in targets
        if t.startswith(above)
    }
    assert not bad, f"core modules import layers above them: {sorted(bad)}"


# Module-level containers that are filled at run time on purpose, with the reason.
RUNTIME_GLOBALS_ALLOWED = {
    # DeepSpeed's get_accelerator()/set_accelerator() is a process-wide choice by its API.
    "zeroshard.deepspeed.accelerator.real_accelerator._chosen",
}


def _package_modules() -> list[Any]:
    names = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))
    return [importlib.import_module(name) for name in names if not name.endswith("__main__")]


def test_no_module_level_registries() -> None:
    """State lives on its owner (the engine, a ``zero.Init`` context, the module a mark is on), never in a
    module-level table keyed by ``id()`` or by module ([Note: parameter owners] in core/owners.py).

    A registry shows as a weak dictionary or set, a container keyed by ``id()``s, or a container that is
    empty at import and filled at run time; constant tables (non-empty, not keyed by ints) pass. The owner
    registries of ``zero.py`` are the one exception: they list the owners' maps and hold no entry.
    """
    weak = (weakref.WeakKeyDictionary, weakref.WeakValueDictionary, weakref.WeakSet)
    found: list[str] = []
    registries: list[str] = []
    for module in _package_modules():
        for attr, value in vars(module).items():
            where = f"{module.__name__}.{attr}"
            if attr.startswith("__") or where in RUNTIME_GLOBALS_ALLOWED:
                continue
            if isinstance(value, OwnerRegistry):
                registries.append(where)
            elif isinstance(value, weak):
                found.append(f"{where} ({type(value).__name__})")
            elif isinstance(value, (dict, set, list)) and type(value) in (dict, set, list):
                if not value:
                    found.append(f"{where} (empty {type(value).__name__}, filled at run time)")
                elif any(type(k) is int and k > 1 << 16 for k in value):  # addresses: id()s
                    found.append(f"{where} ({type(value).__name__} keyed by id())")
    assert not found, f"module-level registries: {found}"
    assert sorted(registries) == ["zeroshard.zero._ENGINES", "zeroshard.zero._INITS"], registries


def test_the_scan_finds_a_registry() -> None:
    """The check above can fail: each kind of registry it looks for is caught."""
    module = types.ModuleType("zeroshard._probe")
    module.by_id = {}  # type: ignore[attr-defined]
    module.by_module = weakref.WeakKeyDictionary()  # type: ignore[attr-defined]
    module.ints = {id(module): "a"}  # type: ignore[attr-defined]
    module.table = {"a": 1, 3: "stage 3"}  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        original = _package_modules
        globals()["_package_modules"] = lambda: [module]
        with pytest.raises(AssertionError) as err:
            test_no_module_level_registries()
    finally:
        globals()["_package_modules"] = original
        del sys.modules[module.__name__]
    message = str(err.value)
    assert "by_id" in message and "by_module" in message and "ints" in message
    assert "table" not in message
