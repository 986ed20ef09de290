"""Classify every name of DeepSpeed's inventory as zeroshard provides it and write docs/deepspeed-surface.md.

    make deepspeed-surface      # = .venv/bin/python tools/deepspeed_surface_report.py

Each name of ``zeroshard/deepspeed/inventory.json`` is looked up in ``zeroshard.deepspeed`` and falls in
one of three classes ([Note: generated surface] in zeroshard/deepspeed/surface.py):

- *implemented*: zeroshard's code with DeepSpeed's semantics, or DeepSpeed's own values (constants, dtypes,
  enums, exception classes) reproduced from the inventory;
- *accepted*: a hand-written no-op where DeepSpeed's behaviour on this hardware is to do nothing (or only to
  record);
- *refused at use*: importing works; calling or constructing raises ``NotImplementedError`` naming the
  feature.

``tests/test_deepspeed_surface.py`` checks that the committed page is what this script writes.
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "deepspeed-surface.md"
PORTING = ROOT / "docs" / "porting.md"
BLOCK = ("<!-- surface-counts: written by `make deepspeed-surface` -->\n", "<!-- /surface-counts -->\n")
DATA_KINDS = ("constant", "package_path", "dtype", "enum", "enum_member", "exception", "module")


def classify() -> dict[tuple[str, str], tuple[str, str]]:
    """``(DeepSpeed module, name) -> (class, detail)`` for every name of the inventory."""
    warnings.simplefilter("ignore")
    from zeroshard.deepspeed import surface

    result: dict[tuple[str, str], tuple[str, str]] = {}
    for ds_module, entry in surface.inventory()["modules"].items():
        module = importlib.import_module(surface.our_name(ds_module))
        for name, item in entry["names"].items():
            value = getattr(module, name)
            kind = surface.kind_of(value)
            if kind == "refused":
                result[ds_module, name] = ("refused", surface.feature_of(ds_module))
            elif kind == "accepted":
                result[ds_module, name] = ("accepted", getattr(value, "__zeroshard_reason__", ""))
            elif kind == "data" or item["kind"] in DATA_KINDS:
                result[ds_module, name] = ("implemented", "DeepSpeed's value")
            else:
                result[ds_module, name] = ("implemented", "zeroshard")
    return result


def summary(classes: dict[tuple[str, str], tuple[str, str]]) -> list[str]:
    """The table of counts (in both pages)."""
    from zeroshard.deepspeed import surface

    counts = Counter(cls for cls, _ in classes.values())
    values = sum(1 for cls, detail in classes.values() if detail == "DeepSpeed's value")
    return [
        "| class | names |",
        "|---|---|",
        f"| implemented | {counts['implemented']} ({counts['implemented'] - values} zeroshard code, {values} "
        "DeepSpeed's constants, enums and exception classes) |",
        f"| accepted | {counts['accepted']} |",
        f"| refused at use | {counts['refused']} |",
        f"| modules | {len(surface.inventory()['modules'])} (all import) |",
    ]


def porting_page(classes: dict[tuple[str, str], tuple[str, str]], text: str) -> str:
    """``text`` (docs/porting.md) with the counts block rewritten."""
    head, rest = text.split(BLOCK[0], 1)
    _, tail = rest.split(BLOCK[1], 1)
    return head + BLOCK[0] + "\n".join(summary(classes)) + "\n" + BLOCK[1] + tail


def render(classes: dict[tuple[str, str], tuple[str, str]]) -> str:
    from zeroshard.deepspeed import surface

    inventory = surface.inventory()
    lines = [
        "# DeepSpeed's public surface in zeroshard",
        "",
        f"Every public name of DeepSpeed {inventory['deepspeed_version']}'s public modules, as "
        "`zeroshard.deepspeed` provides it (what `import deepspeed` gives under `zeroshard launch` or "
        "`ZEROSHARD_AS_DEEPSPEED=1`). Written by `make deepspeed-surface` from "
        "`zeroshard/deepspeed/inventory.json`; see [porting.md](porting.md#deepspeeds-whole-surface) for "
        "what the classes mean.",
        "",
        *summary(classes),
        "",
        "## Implemented by zeroshard's code",
        "",
        "| module | names |",
        "|---|---|",
    ]
    by_module: dict[str, list[str]] = defaultdict(list)
    for (module, name), (cls, detail) in classes.items():
        home = inventory["modules"][module]["names"][name].get("defined_in", module)
        if (
            cls == "implemented"
            and detail == "zeroshard"
            and (home == module or home not in inventory["modules"])
        ):
            by_module[module].append(f"`{name}`")  # listed where DeepSpeed defines it, not at each re-export
    lines += [f"| `{m}` | {', '.join(sorted(n))} |" for m, n in sorted(by_module.items())]
    lines += ["", "## Accepted (no effect, as in DeepSpeed on this hardware)", ""]
    accepted = sorted((m, n, d) for (m, n), (c, d) in classes.items() if c == "accepted")
    lines += [f"- `{m}.{n}`: {d}" for m, n, d in accepted] or ["(none)"]
    lines += ["", "## Refused at use, by feature", "", "| feature | names | modules |", "|---|---|---|"]
    features: dict[str, list[str]] = defaultdict(list)
    for (module, _name), (cls, detail) in classes.items():
        if cls == "refused":
            features[detail].append(module)
    for feature, modules in sorted(features.items(), key=lambda kv: -len(kv[1])):
        shown = sorted(set(modules))
        listed = ", ".join(f"`{m}`" for m in shown[:6]) + (
            f" and {len(shown) - 6} more" if len(shown) > 6 else ""
        )
        lines.append(f"| {feature} | {len(modules)} | {listed} |")
    lines += ["", "## Left out of the inventory", "", "| DeepSpeed modules | why |", "|---|---|"]
    lines += [
        f"| `{prefix.rstrip('.')}`{'.*' if prefix.endswith('.') else ''} | {why} |"
        for prefix, why in inventory["out_of_scope"].items()
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument(
        "--porting", type=Path, default=PORTING, help="the page whose counts block to rewrite"
    )
    args = parser.parse_args(argv)
    classes = classify()
    args.output.write_text(render(classes))
    args.porting.write_text(porting_page(classes, PORTING.read_text()))
    counts = Counter(cls for cls, _ in classes.values())
    print(f"{args.output}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
