"""The user's keys: which a config may contain, how they are spelled (aliases, deprecated spellings), and
messages in that spelling.

[Note: unknown keys] Policy, also in docs/config.md:
- Keys starting with "_" are comments at any depth and are dropped (`"_comment": "..."`).
- Top level: DeepSpeed silently ignores keys it does not know, and real configs carry such keys
  (`cuda_visible_devices`, `comms_config`). An unknown top-level key whose closest known key is at
  least `TOP_LEVEL_CUTOFF` similar (difflib ratio) is taken for a typo and is an error with a
  did-you-mean (`train_batch_szie`, `fp_16`); any other unknown top-level key gets one warning and is
  ignored.
- Inside a known block, any unknown key is an error naming its dotted path, with the closest known
  key as a suggestion. Blocks whose content DeepSpeed passes on unchecked (amp, pipeline, ...) are not
  checked; optimizer and scheduler params are checked by their constructors (`checks.py`).

Deprecated spellings are rewritten in ``deprecated.py`` ([Note: deprecated keys]).

`translate` turns pydantic's validation errors into one plain line per problem, in the user's spelling.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from zeroshard.config.blocks import Block
from zeroshard.config.errors import Problems, show

__all__ = [
    "NOT_CONFIG_KEYS",
    "TOP_LEVEL_CUTOFF",
    "Paths",
    "canonicalize",
    "drop_auto",
    "nested_block",
    "record",
    "split_top_level",
    "top_level_keys",
    "translate",
    "unknown_key_message",
]


TOP_LEVEL_CUTOFF = 0.8
"""difflib ratio from which an unknown top-level key counts as a typo (see [Note: unknown keys])."""
_NESTED_CUTOFF = 0.6

NOT_CONFIG_KEYS = frozenset({"world_size", "warnings"})
"""ZeroshardConfig fields that are filled by zeroshard, not read from the file."""

Paths = dict[tuple[str, ...], str]
"""Maps a canonical location (field names) to the dotted key path the user wrote."""


def top_level_keys(model: type[Block]) -> list[str]:
    """Keys a user may write at the top level (or inside a block of type `model`)."""
    names = [name for name in model.model_fields if name not in NOT_CONFIG_KEYS]
    return names + list(model.input_aliases)


def nested_block(model: type[Block], field: str) -> type[Block] | None:
    """The Block type of `model.field` (through `X | None`), or None for scalars and opaque dicts."""
    annotation = model.model_fields[field].annotation
    candidates: tuple[Any, ...] = (annotation,)
    if get_origin(annotation) in (Union, types.UnionType):
        candidates = get_args(annotation)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Block):
            return candidate
    return None


def _suggest(key: str, known: list[str], cutoff: float) -> str | None:
    matches = difflib.get_close_matches(key, known, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def split_top_level(
    data: Mapping[str, Any], model: type[Block], notes: list[str], problems: Problems
) -> dict[str, Any]:
    """Applies the top-level policy of [Note: unknown keys].

    Returns:
        The known top-level keys and their values; comments and ignored keys are left out.
    """
    known = top_level_keys(model)
    kept: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            problems.add(f"{key!r}: keys must be strings", type_error=True)
            continue
        if key.startswith("_"):
            continue
        if key in known:
            kept[key] = value
            continue
        match = _suggest(key, known, TOP_LEVEL_CUTOFF)
        if match is not None:
            problems.add(f"{key}: unknown key; did you mean '{match}'?")
        else:
            notes.append(
                f"ds_config key '{key}' is not a DeepSpeed setting and is ignored (DeepSpeed ignores it too)"
            )
    return kept


def unknown_key_message(path: str, key: str, known: list[str]) -> str:
    """The message for an unknown key inside a block: a did-you-mean, or the known keys."""
    match = _suggest(key, known, _NESTED_CUTOFF)
    if match is not None:
        return f"{path}: unknown key; did you mean '{match}'?"
    return f"{path}: unknown key; known keys: {', '.join(sorted(known))}"


def canonicalize(
    data: Mapping[str, Any],
    model: type[Block],
    problems: Problems,
    paths: Paths,
    *,
    loc: tuple[str, ...] = (),
    user_path: str = "",
) -> dict[str, Any]:
    """Checks the keys of `data` against `model` and renames input aliases to field names, recursively.

    Unknown keys and keys given under two spellings are recorded in `problems` and left out. Values
    are not validated here. Every location kept is recorded in `paths` with the spelling the user used.

    Returns:
        A new dict keyed by field names.
    """
    known = top_level_keys(model)
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        if not isinstance(key, str):
            problems.add(f"{user_path}.{key!r}: keys must be strings", type_error=True)
            continue
        if key.startswith("_"):
            continue
        path = f"{user_path}.{key}" if user_path else key
        name = model.input_aliases.get(key, key)
        if name not in model.model_fields or name in NOT_CONFIG_KEYS:
            problems.add(unknown_key_message(path, key, known))
            continue
        if name in out:
            problems.add(f"{path}: the same setting is also given as '{spelled[name]}'; keep one of them")
            continue
        spelled[name] = key
        paths[(*loc, name)] = path
        block = nested_block(model, name)
        if block is not None and isinstance(value, Mapping):
            value = canonicalize(value, block, problems, paths, loc=(*loc, name), user_path=path)
        elif block is not None and value is None and model.model_fields[name].default is not None:
            continue  # `"offload_param": null` means the block's defaults
        out[name] = value
    return out


def drop_auto(data: Mapping[str, Any], model: type[Block]) -> dict[str, Any]:
    """Removes every "auto" value left in schema-typed blocks, so the field takes its default.

    This mirrors DeepSpeed, whose pydantic blocks drop "auto" before validation. Opaque dicts
    (optimizer params, amp, ...) are not touched. Expects canonical keys (see `canonicalize`).
    """
    out: dict[str, Any] = {}
    for name, value in data.items():
        if isinstance(value, str) and value == "auto":
            continue
        block = nested_block(model, name) if name in model.model_fields else None
        if block is not None and isinstance(value, Mapping):
            value = drop_auto(value, block)
        out[name] = value
    return out


_TYPE_ERRORS = frozenset(
    {"zs_type", "model_type", "dict_type", "model_attributes_type", "list_type", "string_type", "bool_type"}
)
_RANGES = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _user_path(loc: tuple[int | str, ...], paths: Paths) -> str:
    for cut in range(len(loc), 0, -1):
        head = loc[:cut]
        if all(isinstance(part, str) for part in head) and head in paths:
            rest = [str(part) for part in loc[cut:]]
            return ".".join([paths[head], *rest])  # type: ignore[index]
    return ".".join(str(part) for part in loc) or "(top level)"


def _expected(kind: str, ctx: dict[str, Any], message: str) -> str:
    if kind == "literal_error":
        return "expected one of " + str(ctx.get("expected", "")).replace(" or ", ", ")
    if kind in _RANGES:
        key, sign = _RANGES[kind]
        return f"expected a value {sign} {ctx.get(key)}"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return "expected an object ({...})"
    if kind == "list_type":
        return "expected a list"
    if kind == "string_type":
        return "expected a string"
    return message


def record(item: ErrorDetails, path: str, problems: Problems) -> None:
    """Records one pydantic error `item` about the value at `path` (the user's spelling) in `problems`."""
    kind = item["type"]
    if kind == "missing":
        problems.add(f"{path}: required key is missing")
        return
    if kind == "extra_forbidden":
        problems.add(f"{path}: unknown key")
        return
    expected = _expected(kind, dict(item.get("ctx") or {}), item["msg"])
    problems.add(
        f"{path}: {show(item.get('input'))} is not allowed; {expected}", type_error=kind in _TYPE_ERRORS
    )


def translate(error: ValidationError, paths: Paths, problems: Problems) -> None:
    """Records each error of `error` in `problems` as "<dotted.path>: <value> is not allowed; <what is>"."""
    for item in error.errors(include_url=False):
        record(item, _user_path(tuple(item["loc"]), paths), problems)
