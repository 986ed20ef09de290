"""Deprecated key spellings DeepSpeed still accepts, rewritten to the current keys before validation.

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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zeroshard.config.errors import Problems, show

__all__ = ["DEPRECATED_ZERO_KEYS", "apply_deprecations", "user_spelling"]

DEPRECATED_ZERO_KEYS = (
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
)
"""The deprecated ``zero_optimization`` keys DeepSpeed 0.19 still reads (``cpu_offload_params``, older, it
refuses)."""


_GATHER_NEW = ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save")


def _note(notes: list[str], old: str, new: str) -> None:
    notes.append(f"{old} is deprecated; read as {new}. Use the new key to silence this warning.")


def _both_given(problems: Problems, old: str, new: str, at: str = "") -> None:
    problems.add(f"{at}{old}: given together with {at}{new}, which replaces it; keep only {new}")


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
        _both_given(problems, old, new, at="zero_optimization.")
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
            _both_given(problems, old, given_new[0], at="zero_optimization.")
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
            _both_given(problems, "bfloat16", "bf16")
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
