"""Turns pydantic's validation errors into one plain line per problem, in the user's key spelling."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from zeroshard.config.errors import Problems, show
from zeroshard.config.keys import Paths

__all__ = ["translate"]

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


def translate(error: ValidationError, paths: Paths, problems: Problems) -> None:
    """Records each error of `error` in `problems` as "<dotted.path>: <value> is not allowed; <what is>"."""
    for item in error.errors(include_url=False):
        loc = tuple(item["loc"])
        path = _user_path(loc, paths)
        kind = item["type"]
        if kind == "missing":
            problems.add(f"{path}: required key is missing")
            continue
        if kind == "extra_forbidden":
            problems.add(f"{path}: unknown key")
            continue
        expected = _expected(kind, dict(item.get("ctx") or {}), item["msg"])
        problems.add(
            f"{path}: {show(item.get('input'))} is not allowed; {expected}", type_error=kind in _TYPE_ERRORS
        )
