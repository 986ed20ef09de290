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

[Note: deprecated keys] Deprecated spellings DeepSpeed still accepts are rewritten to the current keys
(`apply_deprecations`), with one warning each:

- `bfloat16` -> `bf16`
- `zero_optimization: true/false` (with top-level `allgather_size`) -> `zero_optimization: {stage: 1/0}`
  (and `allgather_bucket_size`)
- `zero_optimization.cpu_offload: true` -> `zero_optimization.offload_optimizer: {device: cpu}`
- `zero_optimization.cpu_offload_param: true` (or the older `cpu_offload_params`) ->
  `zero_optimization.offload_param: {device: cpu}`
- `zero_optimization.cpu_offload_use_pin_memory` -> `pin_memory` of the offload blocks the two keys
  above create (without them it has no effect, as in DeepSpeed today)
- `zero_optimization.stage3_gather_fp16_weights_on_model_save` ->
  `zero_optimization.gather_16bit_weights_on_model_save`
- `aio.thread_count` -> `aio.intra_op_parallelism`

A deprecated key given together with the key that replaces it is an error, as in DeepSpeed.

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
    "apply_deprecations",
    "canonicalize",
    "drop_auto",
    "nested_block",
    "record",
    "split_top_level",
    "top_level_keys",
    "translate",
    "unknown_key_message",
    "user_spelling",
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


_GATHER_NEW = ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")


def _note(notes: list[str], old: str, new: str) -> None:
    notes.append(f"{old} is deprecated; read as {new}. Use the new key to silence this warning.")


def _flag(zero: dict[str, Any], key: str, problems: Problems) -> bool | None:
    value = zero.pop(key)
    if not isinstance(value, bool):
        problems.add(
            f"zero_optimization.{key}: {show(value)} is not allowed; expected true or false", type_error=True
        )
        return None
    return value


def _cpu_offload(zero: dict[str, Any], old: str, new: str, notes: list[str], problems: Problems) -> bool:
    """Rewrites zero_optimization.<old> into <new>; returns whether it created the <new> block."""
    if old not in zero:
        return False
    if new in zero:
        zero.pop(old)
        problems.add(
            f"zero_optimization.{old}: given together with zero_optimization.{new}, which replaces it; "
            f"keep only {new}"
        )
        return False
    value = _flag(zero, old, problems)
    if value:
        zero[new] = {"device": "cpu"}
        _note(notes, f"zero_optimization.{old}: true", f'zero_optimization.{new}: {{"device": "cpu"}}')
        return True
    if value is False:
        _note(notes, f"zero_optimization.{old}: false", f"no zero_optimization.{new}")
    return False


def _zero(
    block: Mapping[str, Any], notes: list[str], problems: Problems, renamed: dict[str, str]
) -> dict[str, Any]:
    zero = dict(block)
    # DeepSpeed 0.3/0.4 spelled it cpu_offload_params; DeepSpeed 0.19 rejects that spelling.
    legacy_param = "cpu_offload_params" if "cpu_offload_params" in zero else "cpu_offload_param"
    if "cpu_offload_params" in zero and "cpu_offload_param" in zero:
        zero.pop("cpu_offload_params")
        problems.add(
            "zero_optimization.cpu_offload_params: given together with zero_optimization.cpu_offload_param "
            "(two spellings of one deprecated key); keep only offload_param"
        )
        legacy_param = "cpu_offload_param"
    made = [
        new
        for old, new in (("cpu_offload", "offload_optimizer"), (legacy_param, "offload_param"))
        if _cpu_offload(zero, old, new, notes, problems)
    ]
    if "cpu_offload_use_pin_memory" in zero:
        pin = _flag(zero, "cpu_offload_use_pin_memory", problems)
        if pin is not None and made:
            for new in made:
                zero[new]["pin_memory"] = pin
            targets = " and ".join(f"zero_optimization.{new}.pin_memory" for new in made)
            _note(notes, "zero_optimization.cpu_offload_use_pin_memory", targets)
        elif pin is not None:
            notes.append(
                "zero_optimization.cpu_offload_use_pin_memory is deprecated and has no effect without "
                "cpu_offload/cpu_offload_param; set pin_memory inside offload_param/offload_optimizer"
            )
    old = "stage3_gather_fp16_weights_on_model_save"
    if old in zero:
        given_new = [key for key in _GATHER_NEW if key in zero]
        value = zero.pop(old)
        if given_new:
            problems.add(
                f"zero_optimization.{old}: given together with zero_optimization.{given_new[0]}, which "
                f"replaces it; keep only {given_new[0]}"
            )
        else:
            zero[_GATHER_NEW[0]] = value
            renamed[f"zero_optimization.{_GATHER_NEW[0]}"] = f"zero_optimization.{old}"
            _note(notes, f"zero_optimization.{old}", f"zero_optimization.{_GATHER_NEW[0]}")
    return zero


def _aio(
    block: Mapping[str, Any], notes: list[str], problems: Problems, renamed: dict[str, str]
) -> dict[str, Any]:
    aio = dict(block)
    if "thread_count" not in aio:
        return aio
    value = aio.pop("thread_count")
    if "intra_op_parallelism" in aio and aio["intra_op_parallelism"] != value:
        problems.add(
            f"aio.thread_count: {show(value)} contradicts aio.intra_op_parallelism "
            f"{show(aio['intra_op_parallelism'])}, which replaces it; keep only intra_op_parallelism"
        )
        return aio
    aio["intra_op_parallelism"] = value
    renamed["aio.intra_op_parallelism"] = "aio.thread_count"
    _note(notes, "aio.thread_count", "aio.intra_op_parallelism")
    return aio


def apply_deprecations(
    data: Mapping[str, Any], notes: list[str], problems: Problems, renamed: dict[str, str] | None = None
) -> dict[str, Any]:
    """Rewrites deprecated keys (see the module table); appends one warning per rewrite to `notes`.

    Args:
        data: The top-level config as read from the file.
        notes: Collected warning messages.
        problems: Collected errors.
        renamed: Filled with the dotted key each rewritten value now has -> the key the user wrote, so
            that a message about the value names the user's key (see `user_spelling`).

    Returns:
        A new top-level dict using only current keys (nested dicts that changed are copies).
    """
    renamed = {} if renamed is None else renamed
    out = dict(data)
    if "bfloat16" in out:
        legacy = out.pop("bfloat16")
        if "bf16" in out:
            problems.add("bfloat16: given together with bf16, which replaces it; keep only bf16")
        else:
            out["bf16"] = legacy
            renamed["bf16"] = "bfloat16"
            _note(notes, "bfloat16", "bf16")
    zero = out.get("zero_optimization")
    if isinstance(zero, bool):
        new: dict[str, Any] = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in out:
            new["allgather_bucket_size"] = out.pop("allgather_size")
            renamed["zero_optimization.allgather_bucket_size"] = "allgather_size"
        _note(notes, f"zero_optimization: {show(zero)}", f"zero_optimization: {show(new)}")
        out["zero_optimization"] = new
    elif isinstance(zero, Mapping):
        out["zero_optimization"] = _zero(zero, notes, problems, renamed)
    aio = out.get("aio")
    if isinstance(aio, Mapping):
        out["aio"] = _aio(aio, notes, problems, renamed)
    return out


def user_spelling(paths: dict[tuple[str, ...], str], renamed: Mapping[str, str]) -> None:
    """Rewrites the user paths in `paths` (see `keys.Paths`) that a deprecation renamed back to the key
    the user wrote, in place."""
    for loc, path in paths.items():
        for new, old in renamed.items():
            if path == new or path.startswith(new + "."):
                paths[loc] = old + path[len(new) :]
