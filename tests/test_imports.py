"""The package's import graph has no cycles: every ``zeroshard`` import, at module level, under
``TYPE_CHECKING`` or inside a function, points one way (core below engine, engine below the entry points),
and ``zeroshard.core`` imports nothing outside itself.

A cycle here is a design smell before it is a runtime error: a module that needs its importer should take
what it needs as an argument or a protocol (see ``checkpoint/state.py``, ``core/shard_store.ShardStore``).
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


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_from(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of ``from X import ...`` in module ``name`` (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a.b import c`` counts ``a.b.c`` if it is a module).

    Importing a submodule also runs its parents' ``__init__``; those implicit edges are not counted, or the
    package root (which re-exports the public API) would close a cycle with everything.
    """
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and (module := _imported_from(name, path, node)):
                targets = [
                    f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names
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
    assert "zeroshard.core.flat_param" in graph and graph["zeroshard.runtime.engine"], (
        "the walk found no imports"
    )
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def imports_leaving(graph: dict[str, set[str]], package: str) -> set[tuple[str, str]]:
    """The edges ``(module, target)`` of ``graph`` from inside ``package`` to outside it."""

    def inside(module: str) -> bool:
        return module == package or module.startswith(package + ".")

    return {(name, t) for name, targets in graph.items() if inside(name) for t in targets if not inside(t)}


def test_core_imports_nothing_outside_core() -> None:
    """``zeroshard.core`` is the sharded step: it imports nothing of the package outside ``core/`` (not the
    config, ``zero.py``, checkpoints, offload stores, the engine, the CLI or the DeepSpeed names), at module
    level, under ``TYPE_CHECKING`` or inside a function. What it needs is handed to it as plain values
    (``zeroshard/core_config.py``) or as arguments."""
    graph = import_graph(PACKAGE)
    assert graph["zeroshard.core.units"] and graph["zeroshard.core.stage3.gatherer"], "the walk found nothing"
    bad = imports_leaving(graph, "zeroshard.core")
    assert not bad, "core modules import modules outside zeroshard.core: " + ", ".join(
        f"{name} -> {target}" for name, target in sorted(bad)
    )


def test_the_core_rule_finds_every_kind_of_import(tmp_path: Path) -> None:
    """The walk sees imports inside functions and relative ones, and the rule flags those leaving ``core``
    (a sibling whose name starts like ``core`` included), not those within it."""
    package = tmp_path / "pkg"
    (package / "core" / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "",
        "config.py": "",
        "corex.py": "",
        "core/__init__.py": "",
        "core/a.py": "from pkg.core import b\n\ndef f():\n    from pkg.config import X\n",
        "core/b.py": "from . import a\nimport pkg.corex\n",
        "core/sub/__init__.py": "from ...config import Y\nfrom ..a import f\n",
        "engine.py": "from pkg.core.a import f\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["pkg.core.b"] == {"pkg.core.a", "pkg.corex"}
    assert imports_leaving(graph, "pkg.core") == {
        ("pkg.core.a", "pkg.config"),
        ("pkg.core.b", "pkg.corex"),
        ("pkg.core.sub", "pkg.config"),
    }


# Module-level containers that are filled at run time on purpose, with the reason.
RUNTIME_GLOBALS_ALLOWED = {
    # DeepSpeed's get_accelerator()/set_accelerator() is a process-wide choice by its API.
    "zeroshard.deepspeed.accelerator.real_accelerator._chosen",
    # The heartbeats this process started, at most one per world (torch's default group is process-wide):
    # the exit hook and shutdown_distributed stop them; a second engine over the world takes its monitor.
    "zeroshard.watchdog.heartbeat._STARTED",
}


def _package_modules() -> list[Any]:
    names = sorted(_module_name(p) for p in PACKAGE.rglob("*.py"))
    return [importlib.import_module(name) for name in names if not name.endswith("__main__")]


def test_no_module_level_registries() -> None:
    """State lives on its owner (the engine, a ``zero.Init`` context, the module a mark is on), never in a
    module-level table keyed by ``id()`` or by module ([Note: parameter owners] in core/owners.py).

    A registry shows as a weak dictionary or set, a container keyed by ``id()``s, or a container that is
    empty at import and filled at run time; constant tables (non-empty, not keyed by ints) pass. The owner
    registries of ``zero.py`` (engines) and ``core/partitioned.py`` (``zero.Init`` contexts) are the one
    exception: they list the owners' maps and hold no entry.
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
    assert sorted(registries) == ["zeroshard.core.partitioned._INITS", "zeroshard.zero._ENGINES"], registries


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
