"""Check that every DeepSpeed name a body of code uses exists in zeroshard.deepspeed, and how it is provided.

    .venv/bin/python tools/deepspeed_imports_check.py PATH [PATH ...] [--json OUT]

Reads every ``.py`` file under the paths (a checkout of DeepSpeedExamples, DeepSpeed's own ``tests/unit``,
your project) without running it, and collects the DeepSpeed names it uses: ``import deepspeed.X``,
``from deepspeed.X import a, b``, and attribute chains on the module (``deepspeed.runtime.utils.f``,
``deepspeed.comm.get_rank``). Then, in one process with ``ZEROSHARD_AS_DEEPSPEED=1``, imports and looks up
each, and prints a table by class: implemented, accepted, DeepSpeed's values, refused at use, left out of
the inventory (refused at use too), absent (the installed DeepSpeed lacks it too: an outdated script) and
missing (a gap in zeroshard).
Nothing is executed from the scanned files.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _chain(node: ast.AST) -> list[str] | None:
    """``deepspeed.a.b`` as ``["deepspeed", "a", "b"]``; ``None`` for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "deepspeed":
        return ["deepspeed", *reversed(parts)]
    return None


def uses(source: str) -> set[tuple[str, str | None]]:
    """``(module, name)`` pairs a file uses (``name`` None: the module itself)."""
    found: set[tuple[str, str | None]] = set()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "deepspeed" or alias.name.startswith("deepspeed."):
                    found.add((alias.name, None))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "deepspeed" or node.module.startswith("deepspeed."):
                found.update((node.module, a.name) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
            parts = _chain(node)
            if parts is not None and len(parts) >= 2:
                found.add((".".join(parts[:-1]), parts[-1]))
    return found


PROBE = """
import enum, importlib, json, os, sys, warnings
import torch
warnings.simplefilter("ignore")
alias = os.environ.get("ZEROSHARD_AS_DEEPSPEED") == "1"
if alias:
    from zeroshard.deepspeed import surface

def resolve(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return value
    raise ImportError(dotted)

def kind(value):
    marked = getattr(value, "__zeroshard_surface__", None)
    home = surface.deepspeed_name(str(getattr(value, "__module__", "") or ""))
    if marked == "left out" or (marked == "refused" and surface.scoped_out(home)):
        return "left out"
    found = surface.kind_of(value)
    plain = (type(None), bool, int, float, str, tuple, list, dict, enum.Enum, torch.dtype)
    return "data" if found == "implemented" and isinstance(value, plain) else found

out = {}
for dotted in json.loads(sys.stdin.read()):
    try:
        value = resolve(dotted)
    except Exception as error:
        out[dotted] = ["missing", type(error).__name__ + ": " + str(error)[:200]]
        continue
    out[dotted] = [kind(value) if alias else "present", ""]
print(json.dumps(out))
"""


def _probe(names: list[str], alias: bool) -> dict[str, list[str]]:
    """Resolve ``names`` in a fresh process: zeroshard's tree (``alias``) or the installed DeepSpeed."""
    if not names:
        return {}
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "ZEROSHARD_AS_DEEPSPEED")}
    env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    if alias:
        env.update(ZEROSHARD_AS_DEEPSPEED="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        input=json.dumps(names),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--json", type=Path, help="write the per-name results here")
    args = parser.parse_args(argv)
    where: dict[tuple[str, str | None], set[str]] = defaultdict(set)
    files = 0
    for root in args.paths:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            files += 1
            for use in uses(path.read_text(errors="replace")):
                where[use].add(str(path))
    dotted = {m + ("." + n if n else ""): users for (m, n), users in where.items()}
    results = _probe(sorted(dotted), alias=True)
    in_deepspeed = _probe(sorted(k for k, (kind, _) in results.items() if kind == "missing"), alias=False)
    for key, (kind, _) in in_deepspeed.items():
        if kind == "missing":
            results[key][0] = "absent"  # DeepSpeed 0.19.8 lacks it too (an outdated script)
    counts = Counter(kind for kind, _ in results.values())
    print(f"{files} files, {len(results)} distinct DeepSpeed names used")
    for kind in ("implemented", "accepted", "data", "refused", "left out", "absent", "missing"):
        print(f"  {kind:12s} {counts.get(kind, 0)}")
    for key, (kind, error) in sorted(results.items()):
        if kind in ("missing", "absent"):
            print(f"  {kind}: {key}  ({error}; used in {sorted(dotted[key])[0]})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
