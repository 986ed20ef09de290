"""Checks of the free-form ``optimizer.params`` and ``scheduler.params`` of a ds_config.

These blocks are keyword arguments of a constructor (an optimizer class, an LR schedule), so their keys
and value kinds come from the constructor's signature. :mod:`zeroshard.optim_factory` and
:mod:`zeroshard.lr_schedules` call these checks while they build; `load_config` builds both over a
stand-in parameter with the same code (see [Note: one validation] in ``checks.py``), so `check-config` and
`initialize()` refuse the same params with the same message, naming ``optimizer.params.<key>`` or
``scheduler.params.<key>``.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from zeroshard.errors import ArgumentTypeError

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_keys",
    "check_number",
    "check_value",
    "checked_kwargs",
    "did_you_mean",
    "is_number",
    "keyword_defaults",
    "resolve_name",
]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest of ``choices``, or ``""``.

    Matching ignores case, so ``"adamw"`` suggests ``"AdamW"``.
    """
    by_lower = {choice.lower(): choice for choice in choices}
    matches = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[matches[0]]!r}?)" if matches else ""


def resolve_name(
    path: str, value: object, names: Iterable[str], kind: str, shown: Iterable[str] | None = None
) -> str:
    """Match ``value`` case-insensitively against ``names`` and return the canonical spelling.

    Args:
        path: Config key path used in messages, e.g. ``"optimizer.type"``.
        value: The user's value.
        names: Canonical names, e.g. ``["Adam", "AdamW", "SGD"]``.
        kind: Word used in messages, e.g. ``"optimizer"``.
        shown: Names to suggest and list when nothing matches; default ``names``.

    Raises:
        TypeError: ``value`` is not a string.
        ValueError: ``value`` matches no name; the message lists ``shown`` with a did-you-mean.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{path}: expected a string naming the {kind}, got {value!r} ({type(value).__name__})"
        )
    canonical = {name.lower(): name for name in names}
    if value.lower() in canonical:
        return canonical[value.lower()]
    listed = sorted(set(canonical.values() if shown is None else shown), key=str.lower)
    raise ValueError(
        f"{path}: unknown {kind} {value!r}{did_you_mean(value, listed)}. "
        f"Accepted (case-insensitive): {', '.join(listed)}."
    )


def keyword_defaults(fn: Callable[..., Any], skip: Iterable[str] = ()) -> dict[str, Any]:
    """Map each keyword-passable parameter of ``fn`` to its default.

    Parameters without a default map to :data:`inspect.Parameter.empty`. ``*args``,
    ``**kwargs``, ``self`` and the names in ``skip`` are left out.
    """
    skipped = {"self", *skip}
    return {
        name: param.default
        for name, param in inspect.signature(fn).parameters.items()
        if name not in skipped
        and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def check_keys(section: str, given: Iterable[str], accepted: Iterable[str], owner: str) -> None:
    """Raise if any key in ``given`` is not in ``accepted``.

    Args:
        section: Key path prefix, e.g. ``"optimizer.params"``.
        given: Keys the user wrote.
        accepted: Keys the target accepts.
        owner: What the keys are passed to, e.g. ``"torch.optim.AdamW"``.

    Raises:
        ValueError: Naming the first unknown key, the owner, a did-you-mean and every accepted key.
    """
    accepted_sorted = sorted(set(accepted))
    for key in given:
        if key not in accepted_sorted:
            raise ValueError(
                f"{section}.{key}: unknown key for {owner}{did_you_mean(key, accepted_sorted)}. "
                f"Accepted keys: {', '.join(accepted_sorted) or '(none)'}."
            )


def check_value(path: str, value: Any, default: Any) -> Any:
    """Check ``value`` has the kind of the constructor default it replaces.

    A bool default needs a bool; a number default needs an int or float (not a bool); a tuple
    default needs a list or tuple of the same length, returned as a tuple (JSON has no tuples);
    a string default needs a string. A ``None`` or missing default accepts anything, leaving
    the check to the constructor.

    Returns:
        ``value``, with lists converted to tuples where the default is a tuple.

    Raises:
        TypeError: Naming ``path``, the value and the expected kind.
    """
    if default is inspect.Parameter.empty or default is None:
        return value
    if isinstance(default, bool):
        return check_bool(path, value)
    if isinstance(default, int | float):
        return check_number(path, value)
    if isinstance(default, tuple):
        if not isinstance(value, list | tuple) or len(value) != len(default):
            raise TypeError(
                f"{path}: expected a list of {len(default)} values like {list(default)}, got {value!r}"
            )
        for index, (item, item_default) in enumerate(zip(value, default, strict=True)):
            check_value(f"{path}[{index}]", item, item_default)
        return tuple(value)
    if isinstance(default, str) and not isinstance(value, str):
        raise TypeError(f"{path}: expected a string, got {value!r} ({type(value).__name__})")
    return value


def is_number(value: object) -> bool:
    """Return whether ``value`` is an int or float and not a bool (JSON ``true`` is not a number)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_number(path: str, value: object) -> float:
    """Return ``value`` if it is a finite int or float (not a bool).

    Raises:
        TypeError: Not a number (an ``ArgumentTypeError``, also a ``ValueError``, as DeepSpeed raises).
        ValueError: NaN or infinite. Both name ``path``.
    """
    if not is_number(value):
        raise ArgumentTypeError(f"{path}: expected a number, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path}: {value!r} is not allowed; expected a finite number")
    return value  # type: ignore[return-value]


def check_int(path: str, value: object, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) and at least ``minimum``.

    Raises:
        TypeError: Not an int (an ``ArgumentTypeError``, also a ``ValueError``, as DeepSpeed raises).
        ValueError: Below ``minimum``. Both name ``path``.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentTypeError(f"{path}: expected an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{path}: expected an integer >= {minimum}, got {value}")
    return value


def check_bool(path: str, value: object) -> bool:
    """Return ``value`` if it is a bool; raise TypeError naming ``path``."""
    if not isinstance(value, bool):
        raise TypeError(f"{path}: expected true or false, got {value!r} ({type(value).__name__})")
    return value


def check_choice(path: str, value: object, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``; raise ValueError naming ``path`` and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{path}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def checked_kwargs(section: str, params: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Check every value of ``params`` against ``defaults`` (see :func:`check_value`)."""
    return {key: check_value(f"{section}.{key}", value, defaults.get(key)) for key, value in params.items()}
