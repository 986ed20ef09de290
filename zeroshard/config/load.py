"""`load_config`: from a ds_config (a dict, a JSON file, or DeepSpeed's base64 JSON) to a resolved, validated
`ZeroshardConfig`, and where `initialize()` finds the config (its arguments and the command-line flags).

The steps: read the source with limits (UTF-8, finite numbers, nesting depth, no duplicate keys); rewrite
deprecated keys, apply the unknown-key policy and rename aliases (`keys.py`); check the blocks of
features zeroshard does not implement (`features.py`); resolve "auto" and complete the batch triad
(`resolve.py`); validate types and ranges (pydantic, messages from `keys.py`); check rules across
settings and build the optimizer and scheduler over a stand-in (`checks.py`); warn about features
zeroshard does not implement. All problems are collected and raised together; all warnings are emitted
at the end and kept on the config.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from zeroshard.config.checks import check_config, out_of_scope_warnings
from zeroshard.config.errors import ConfigError, ConfigTypeError, ConfigWarning, Problems
from zeroshard.config.features import check_feature_blocks
from zeroshard.config.keys import (
    Paths,
    apply_deprecations,
    canonicalize,
    drop_auto,
    split_top_level,
    translate,
    user_spelling,
)
from zeroshard.config.resolve import GAS, MICRO, TRAIN, AutoContext, BatchSizes, resolve_auto, resolve_batch
from zeroshard.config.schema import ZeroshardConfig

__all__ = [
    "MAX_DEPTH",
    "ConfigSource",
    "add_config_arguments",
    "load_config",
    "read_source",
    "resolve_config_source",
]


ConfigSource = dict[str, Any] | str | os.PathLike[str]
"""A ds_config as a dict, or the path of its JSON file."""


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds zeroshard's flags to `parser`, like `deepspeed.add_config_arguments`.

    Adds an argument group "zeroshard" with `--deepspeed` and `--zeroshard` (flags for the user's own
    script; zeroshard does not read them) and `--deepspeed_config` / `--zeroshard_config` (one option
    under two names, stored as `args.deepspeed_config`).

    Args:
        parser: The parser to extend.

    Returns:
        The same parser, for chaining.
    """
    group = parser.add_argument_group("zeroshard", "zeroshard (DeepSpeed-compatible) configuration")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="enable zeroshard (a flag for your script)"
    )
    group.add_argument(
        "--zeroshard", default=False, action="store_true", help="enable zeroshard (a flag for your script)"
    )
    group.add_argument(
        "--deepspeed_config",
        "--zeroshard_config",
        dest="deepspeed_config",
        default=None,
        type=str,
        help="path of the DeepSpeed ds_config JSON file",
    )
    return parser


def _same(a: object, b: object) -> bool:
    if a is b:
        return True
    # Two spellings of one path are the same source; two dicts are only the same object.
    if isinstance(a, str | os.PathLike) and isinstance(b, str | os.PathLike):
        return os.path.abspath(os.fspath(a)) == os.path.abspath(os.fspath(b))
    return False


def resolve_config_source(config: Any, config_params: Any, args: Any) -> ConfigSource:
    """Picks the one config among the ways `initialize()` accepts it.

    DeepSpeed's `initialize` takes `config=`, the older `config_params=`, and `args.deepspeed_config`
    (zeroshard also reads `args.zeroshard_config` and DeepSpeed's deprecated `args.deepscale_config`).
    Unlike DeepSpeed, which quietly prefers `config` over `config_params`, giving two different sources
    is an error: it is unclear which one the user meant.

    Args:
        config: `initialize(config=...)`, or None.
        config_params: `initialize(config_params=...)`, or None.
        args: The argparse namespace given to `initialize(args=...)`, or None.

    Returns:
        The single source given (a dict or a path); `load_config` reads it.

    Raises:
        ValueError: When none is given, or when two different ones are.
    """
    given: list[tuple[str, Any]] = []
    for name, value in (("config", config), ("config_params", config_params)):
        if value is not None:
            given.append((name, value))
    for attr in ("deepspeed_config", "zeroshard_config", "deepscale_config"):
        value = getattr(args, attr, None) if args is not None else None
        if value is not None:
            given.append((f"args.{attr}", value))
    if not given:
        raise ValueError(
            "no config given: pass config=<dict or path to ds_config.json> to initialize(), "
            "or --deepspeed_config <path> on the command line (see add_config_arguments)"
        )
    first_name, first = given[0]
    chosen: dict[str, Any] | str | os.PathLike[str] = first
    different = [name for name, value in given[1:] if not _same(first, value)]
    if different:
        names = ", ".join([first_name, *different])
        raise ValueError(f"config given more than once ({names}); keep exactly one of them")
    return chosen


MAX_DEPTH = 32
"""The deepest nesting of objects and lists a config may have (DeepSpeed's own configs reach 4)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"key '{key}' appears twice in one object")
        seen[key] = value
    return seen


def _parse_json(text: str, origin: str) -> Any:
    try:
        # NaN and Infinity parse as floats here so that `_check_finite` can refuse them naming their key.
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise ConfigError(f"{origin} is nested too deeply to be a config") from None
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{origin} is not valid JSON: line {err.lineno}, column {err.colno}: {err.msg}"
        ) from None
    except ValueError as err:  # raised by _no_duplicates
        raise ConfigError(f"{origin}: {err} (DeepSpeed rejects duplicate keys too)") from None


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
    """Reads a config given as a dict, a path to a JSON file, or DeepSpeed's base64-encoded JSON.

    Returns:
        A copy of the top-level object, and a name for it in messages ("ds_config" or the path).

    Raises:
        ConfigError: When the file is missing, is not UTF-8 (naming the key that holds the bytes), is not
            valid JSON (with line and column), is nested too deeply, or holds a non-finite number in
            optimizer or scheduler params.
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
    if path.is_file():
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


def _check_arguments(world_size: Any, hidden_size: Any, model_dtype: Any, client_optimizer: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is not allowed; expected an integer >= 1")
    if hidden_size is not None and (
        isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 1
    ):
        raise ValueError(f"hidden_size: {hidden_size!r} is not allowed; expected an integer >= 1 or None")
    if model_dtype is not None and not isinstance(model_dtype, torch.dtype):
        raise TypeError(f"model_dtype: {model_dtype!r} is not allowed; expected a torch.dtype or None")
    if client_optimizer is not None and not isinstance(getattr(client_optimizer, "defaults", None), dict):
        raise TypeError(
            f"client_optimizer: {type(client_optimizer).__name__} has no `defaults` dict; expected a "
            f"torch.optim.Optimizer or None"
        )


def _validate(
    data: dict[str, Any], batch: BatchSizes | None, world_size: int, paths: Paths, problems: Problems
) -> ZeroshardConfig | None:
    # With a broken triad, validate the rest anyway (placeholder sizes) so every problem is reported.
    sizes = batch or BatchSizes(train=world_size, micro=1, gas=1)
    full = {**data, TRAIN: sizes.train, MICRO: sizes.micro, GAS: sizes.gas, "world_size": world_size}
    try:
        return ZeroshardConfig.model_validate(full)
    except ValidationError as err:
        translate(err, paths, problems)
        return None


def load_config(
    source: ConfigSource,
    *,
    world_size: int,
    hidden_size: int | None = None,
    model_dtype: torch.dtype | None = None,
    client_optimizer: torch.optim.Optimizer | None = None,
    optimizer_given: bool | None = None,
) -> ZeroshardConfig:
    """Reads, resolves and validates a DeepSpeed ds_config.

    Args:
        source: The config as a dict, or the path of its JSON file.
        world_size: Data-parallel world size (resolves the batch triad).
        hidden_size: The model's hidden size, when known (resolves "auto" bucket sizes).
        model_dtype: Dtype of the model's parameters, when known (resolves `enabled: "auto"` of fp16/bf16).
        client_optimizer: The optimizer given to `initialize()`, if any (resolves "auto" optimizer params).
        optimizer_given: Whether `initialize()` was given an optimizer, as an object or as a callable
            (default: whether `client_optimizer` is given). Without one, a `scheduler` block or NVMe
            optimizer offload needs an `optimizer` block.

    Returns:
        The frozen, resolved config; `config.warnings` repeats the warnings emitted.

    Raises:
        ConfigError: A `ValueError` listing every problem, one per line, each naming its dotted key,
            the value and what is allowed (`ConfigTypeError`, also a `TypeError`, when one is a type).
        ValueError: When the file is missing or not valid JSON, or an argument is out of range.
        TypeError: When the source or an argument has the wrong type.

    Warns:
        ConfigWarning: Once per deprecated key rewritten, ignored top-level key, setting without
            effect, and out-of-scope feature turned on.
    """
    _check_arguments(world_size, hidden_size, model_dtype, client_optimizer)
    raw, origin = read_source(source)
    problems = Problems()
    notes: list[str] = []
    renamed: dict[str, str] = {}
    data = apply_deprecations(raw, notes, problems, renamed)
    data = split_top_level(data, ZeroshardConfig, notes, problems)
    paths: Paths = {}
    data = canonicalize(data, ZeroshardConfig, problems, paths)
    user_spelling(paths, renamed)
    data = check_feature_blocks(data, problems)
    ctx = AutoContext(world_size, hidden_size, model_dtype, client_optimizer)
    data, given, auto = resolve_auto(data, ctx, problems)
    data = drop_auto(data, ZeroshardConfig)
    batch = resolve_batch(given, world_size, problems, auto=auto)
    cfg = _validate(data, batch, world_size, paths, problems)
    if cfg is not None:
        has_optimizer = client_optimizer is not None if optimizer_given is None else optimizer_given
        check_config(cfg, problems, notes, optimizer_given=has_optimizer)
    problems.raise_if_any(origin)
    if cfg is None:  # unreachable: _validate records a problem whenever it returns None
        raise RuntimeError("config validation failed without reporting a problem")
    notes.extend(out_of_scope_warnings(cfg))
    for message in notes:
        warnings.warn(message, ConfigWarning, stacklevel=2)
    return cfg.model_copy(update={"warnings": tuple(notes)})
