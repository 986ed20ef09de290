"""Reading a ds_config's text: `read_source` turns a dict, a file (JSON or Hjson) or DeepSpeed's base64
string into a plain dict, with limits (UTF-8, nesting depth, finite numbers, no duplicate keys).

[Note: Hjson]
DeepSpeed reads config files (and base64 configs) with the ``hjson`` package: comments (``#``, ``//``,
``/* */``), trailing commas, unquoted keys and strings and multi-line strings are accepted, and the
DeepSpeed test suite and user configs rely on that. zeroshard reads a file as strict JSON first (its
errors give the line and column of the first JSON error, and NaN / Infinity / 1e400 parse as numbers that
`_check_finite` refuses by key) and, only when that fails, as Hjson, with the same duplicate-key refusal.
A file neither parser accepts is reported with Hjson's line and column, the more lenient reading. Hjson
reads the bare words NaN and Infinity as strings, which the typed fields then refuse.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from zeroshard.config.errors import ConfigError, ConfigTypeError

__all__ = ["MAX_DEPTH", "ConfigSource", "read_source"]

ConfigSource = dict[str, Any] | str | os.PathLike[str]
"""A ds_config as a dict, or the path of its JSON (or Hjson) file."""

MAX_DEPTH = 32
"""The deepest nesting of objects and lists a config may have (DeepSpeed's own configs reach 4)."""


class _DuplicateKey(ValueError):
    """A key twice in one object: raised inside either parser, reported by `_parse_json`."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(f"key '{key}' appears twice in one object")
        seen[key] = value
    return seen


def _parse_json(text: str, origin: str) -> Any:
    """The value `text` holds, read as JSON or else as Hjson ([Note: Hjson]).

    Raises:
        ConfigError: Neither parser reads it (naming the line and column of each one's first error), a
            key appears twice in one object, or it is nested too deeply.
    """
    try:
        # NaN and Infinity parse as floats here so that `_check_finite` can refuse them naming their key.
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        as_json = f"line {err.lineno}, column {err.colno}: {err.msg}"
    except RecursionError:
        raise ConfigError(f"{origin} is nested too deeply to be a config") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{origin}: {err} (DeepSpeed rejects duplicate keys too)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ConfigError(f"{origin} is nested too deeply to be a config") from None
    except _DuplicateKey as err:
        raise ConfigError(f"{origin}: {err} (DeepSpeed rejects duplicate keys too)") from None
    except hjson.HjsonDecodeError as err:
        as_hjson = f"line {err.lineno}, column {err.colno}: {err.msg}"
    except (ValueError, OverflowError) as err:  # a number Hjson cannot convert (1e400)
        as_hjson = str(err)
    raise ConfigError(
        f"{origin} is not valid JSON: {as_json}; nor Hjson, which DeepSpeed also reads: {as_hjson}"
    )


def _copy_tree(value: Any) -> Any:
    # Copies the JSON-like containers but not the leaves: a dict config may hold objects (an mpu, a
    # process group) that must not be deep-copied.
    if isinstance(value, Mapping):
        return {key: _copy_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_tree(item) for item in value]
    return value


def _decode_base64(text: str) -> str | None:
    # DeepSpeed's launcher may pass the config as urlsafe base64 JSON instead of a path.
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        return None
    return decoded if decoded.lstrip().startswith("{") else None


def _undecodable_key(value: Any, key: str = "") -> str | None:
    """The dotted key of the first key or string holding a byte that is not UTF-8 (a lone surrogate after
    decoding with ``surrogateescape``), or None."""
    if isinstance(value, str):
        return key if any("\udc80" <= char <= "\udcff" for char in value) else None
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for name, item in value.items():
            path = f"{key}.{name}" if key else name
            if _undecodable_key(name, path) is not None:
                return path
            items.append((path, item))
    elif isinstance(value, list):
        items = [(f"{key}[{index}]", item) for index, item in enumerate(value)]
    for path, item in items:
        found = _undecodable_key(item, path)
        if found is not None:
            return found
    return None


def _read_text(path: Path, origin: str) -> str:
    """The file's text; bytes that are not UTF-8 are an error naming the key that holds them."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        column = err.start - (raw.rfind(b"\n", 0, err.start) + 1) + 1
        where = f"byte 0x{raw[err.start]:02x} at line {line}, column {column}"
    try:
        key = _undecodable_key(_parse_json(raw.decode("utf-8", errors="surrogateescape"), origin))
    except (ConfigError, RecursionError):
        key = None
    # The key itself may hold the bytes: show them escaped (\xfe), a lone surrogate cannot be printed.
    shown = f"{key.encode('utf-8', 'surrogateescape').decode('utf-8', 'backslashreplace')}: " if key else ""
    raise ConfigError(f"{origin}: {shown}not UTF-8 text ({where}); a config must be UTF-8 encoded JSON")


def read_source(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """Reads a config given as a dict, a path to a JSON (or Hjson) file, or DeepSpeed's base64 form of one.

    Returns:
        A copy of the top-level object, and a name for it in messages ("ds_config" or the path).

    Raises:
        ConfigError: When the file is missing, is not UTF-8 (naming the key that holds the bytes), is
            neither JSON nor Hjson (with the line and column of each), is nested too deeply, or holds a
            non-finite number in optimizer or scheduler params.
        ConfigTypeError: When the source or its top level is not an object.
    """
    if isinstance(source, Mapping):
        _check_depth(source, "ds_config")
        data = _copy_tree(source)
        _check_finite(data, "ds_config")
        return data, "ds_config"
    if not isinstance(source, str | os.PathLike):
        raise ConfigTypeError(
            f"config must be a dict or the path of a JSON file, not {type(source).__name__}"
        )
    path = Path(source)
    if os.path.isfile(path):  # False, not OSError, for a name too long to be a path (a base64 config)
        origin = f"ds_config {path}"
        data = _parse_json(_read_text(path, origin), origin)
    else:
        decoded = _decode_base64(source) if isinstance(source, str) else None
        if decoded is None:
            raise ConfigError(f"config file not found: {path}")
        origin = "ds_config (base64)"
        data = _parse_json(decoded, origin)
    if not isinstance(data, dict):
        raise ConfigTypeError(
            f"{origin}: the top level must be a JSON object ({{...}}), not {type(data).__name__}"
        )
    _check_depth(data, origin)
    _check_finite(data, origin, everywhere=True)
    return data, origin


def _check_depth(data: Mapping[str, Any], origin: str) -> None:
    """Refuse objects and lists nested deeper than `MAX_DEPTH`, naming the key (walked without recursion,
    so a self-referencing dict config is refused too)."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        key, value, depth = stack.pop()
        if depth > MAX_DEPTH:
            shown = key if len(key) <= 80 else key[:60] + "..."
            raise ConfigError(
                f"{origin}: {shown}: nested deeper than {MAX_DEPTH} levels of objects and lists; "
                f"a ds_config is a few levels deep"
            )
        if isinstance(value, Mapping):
            stack.extend((f"{key}.{k}" if key else str(k), v, depth + 1) for k, v in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((f"{key}[{i}]", v, depth + 1) for i, v in enumerate(value))


def _check_finite(data: dict[str, Any], origin: str, *, everywhere: bool = False) -> None:
    """Refuse NaN and infinite numbers, naming the key.

    In a file (``everywhere``) no number may be NaN or infinite: JSON has no such numbers, Python's parser
    reads the tokens NaN and Infinity, and a number beyond float range (``1e400``) reads as infinity. A dict
    config is checked in the optimizer's and scheduler's ``params`` only: those are free-form keyword
    arguments, the typed blocks refuse non-finite values in their own validation, and accelerate writes
    ``steps_per_print: float("inf")`` for "never"."""
    stack: list[tuple[str, Any]] = (
        [("", data)]
        if everywhere
        else [
            (f"{block}.params", data[block].get("params"))
            for block in ("optimizer", "scheduler")
            if isinstance(data.get(block), dict)
        ]
    )
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            shown = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")  # JSON's names
            raise ConfigError(f"{origin}: {key}: {shown} is not allowed; expected a finite number")
        if isinstance(value, dict):
            stack.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
