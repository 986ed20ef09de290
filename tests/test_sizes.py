"""The size budget of zeroshard/ (tools/check_sizes.py), run in-process: CI runs only the tests, so this is
what enforces it there (``make lint`` runs the script too)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_sizes", ROOT / "tools" / "check_sizes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sizes = _load()


def test_zeroshard_within_budget() -> None:
    failures = sizes.check()
    assert not failures, "size budget (tools/check_sizes.py):\n" + "\n".join(failures)


def _tree(tmp_path: Path, body: str, extra_lines: int = 0) -> Path:
    package = tmp_path / "zeroshard"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(body + "\n" * extra_lines)
    return tmp_path


def _function(name: str, lines: int, indent: str = "") -> str:
    """A ``def`` of exactly ``lines`` lines (decorated: the decorator does not count)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}@staticmethod\n{indent}def {name}() -> None:\n{body}"


def test_what_counts(tmp_path: Path) -> None:
    source = "class A:\n" + _function("f", 61, "    ") + "\n\n" + _function("g", 60) + "\n# trailing\n"
    root = _tree(tmp_path, source)
    modules, functions = sizes.measure(root)
    assert functions == {"zeroshard.mod:A.f": 61, "zeroshard.mod:g": 60}
    assert modules == {"zeroshard": 0, "zeroshard.mod": len(source.splitlines())}
    assert sizes.check(root, {}) == [
        "zeroshard.mod:A.f: function of 61 lines > 60; split it (or defend it in ALLOWED)"
    ]


def test_nested_functions_count_twice(tmp_path: Path) -> None:
    inner = "".join(f"        y{i} = {i}\n" for i in range(61))
    root = _tree(tmp_path, f"def outer() -> None:\n    def inner() -> None:\n{inner}")
    _, functions = sizes.measure(root)
    assert functions == {"zeroshard.mod:outer": 63, "zeroshard.mod:outer.inner": 62}


@pytest.mark.parametrize(
    ("lines", "recorded", "fails"),
    [
        (110, 100, None),  # +10% exactly: allowed
        (111, 100, "grew to 111 (> 110, +10%)"),
        (61, 100, None),  # shrunk but still over the budget: allowed
        (60, 100, "now 60 <= 60; remove it from ALLOWED"),
    ],
)
def test_allowed_entries(tmp_path: Path, lines: int, recorded: int, fails: str | None) -> None:
    root = _tree(tmp_path, _function("f", lines))
    failures = sizes.check(root, {"zeroshard.mod:f": recorded})
    if fails is None:
        assert failures == []
    else:
        assert len(failures) == 1 and fails in failures[0], failures


def test_allowed_module_and_stale_entries(tmp_path: Path) -> None:
    root = _tree(tmp_path, "x = 1\n", extra_lines=420)
    assert sizes.check(root, {"zeroshard.mod": 421}) == []
    assert sizes.check(root, {"zeroshard.mod": 421, "zeroshard.gone:f": 70}) == [
        "zeroshard.gone:f: in ALLOWED but no such module or function; remove or rename its entry"
    ]
    assert sizes.check(root, {}) == [
        "zeroshard.mod: module of 421 lines > 400; split it (or defend it in ALLOWED)"
    ]


def test_recorded_sizes_are_over_the_limit() -> None:
    """An entry recorded at or under its limit would allow nothing: a typo in the list."""
    for name, recorded in sizes.ALLOWED.items():
        limit = sizes.FUNCTION_LIMIT if ":" in name else sizes.MODULE_LIMIT
        assert recorded > limit, name
