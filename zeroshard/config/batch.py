"""The batch triad: train_batch_size = micro * gradient_accumulation_steps * world_size.

Mirrors DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion`: any two of the three
determine the third (with integer division, as DeepSpeed does); with one of them given, gradient
accumulation is 1; gradient_accumulation_steps alone, or nothing, is an error. Every resolved value must
be at least 1 and the equation must hold exactly. "auto" counts as not given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.base import INT_MAX
from zeroshard.config.errors import Problems, show

__all__ = ["GAS", "MICRO", "TRAIN", "TRIAD", "BatchSizes", "resolve_batch"]

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"
TRIAD = (TRAIN, MICRO, GAS)


@dataclass(frozen=True)
class BatchSizes:
    """A consistent triad: `train == micro * gas * world_size`, all at least 1."""

    train: int
    micro: int
    gas: int


def _given_value(key: str, value: Any, problems: Problems) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.add(f"{key}: {show(value)} is not allowed; expected an integer >= 1", type_error=True)
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        problems.add(f"{key}: {show(value)} is not allowed; expected an integer >= 1")
        return None
    if value < 1:
        problems.add(f"{key}: {int(value)} is not allowed; expected an integer >= 1")
        return None
    if value > INT_MAX:
        problems.add(f"{key}: {show(value)} is not allowed; expected an integer from 1 to {INT_MAX}")
        return None
    return int(value)


def _none_given(auto: frozenset[str]) -> str:
    if auto:
        names = ", ".join(key for key in TRIAD if key in auto)
        return (
            f'{names}: "auto" cannot be resolved here; zeroshard infers one batch value from the other two '
            f"and the world size, so set {MICRO} (and {GAS}, default 1) or {TRAIN} to a number"
        )
    return f"no batch size given: set {TRAIN} or {MICRO} ({GAS} alone is not enough)"


def resolve_batch(
    given: Mapping[str, Any], world_size: int, problems: Problems, *, auto: frozenset[str] = frozenset()
) -> BatchSizes | None:
    """Completes and checks the triad.

    Args:
        given: The triad keys present in the config (not "auto") and their raw values.
        world_size: Data-parallel world size.
        problems: Where problems are recorded.
        auto: Triad keys that were "auto", named in the message when nothing can resolve them.

    Returns:
        The resolved sizes, or None when a problem was recorded.
    """
    values = {key: _given_value(key, given[key], problems) for key in TRIAD if key in given}
    if any(value is None for value in values.values()):
        return None
    t, m, g = values.get(TRAIN), values.get(MICRO), values.get(GAS)
    ws = world_size
    inferred: dict[str, tuple[int, str]] = {}
    if t is not None and m is not None and g is None:
        inferred[GAS] = (t // m // ws, f"{TRAIN} {t} // {MICRO} {m} // world_size {ws}")
    elif t is not None and g is not None and m is None:
        inferred[MICRO] = (t // ws // g, f"{TRAIN} {t} // world_size {ws} // {GAS} {g}")
    elif m is not None and g is not None and t is None:
        inferred[TRAIN] = (m * g * ws, f"{MICRO} {m} * {GAS} {g} * world_size {ws}")
    elif t is not None and m is None and g is None:
        inferred[GAS] = (1, "the default when only train_batch_size is given")
        inferred[MICRO] = (t // ws, f"{TRAIN} {t} // world_size {ws}")
    elif m is not None and t is None and g is None:
        inferred[GAS] = (1, "the default when only the micro batch is given")
        inferred[TRAIN] = (m * ws, f"{MICRO} {m} * world_size {ws}")
    elif t is None and m is None:
        problems.add(_none_given(auto))
        return None
    for key, (value, how) in inferred.items():
        if value < 1:
            problems.add(
                f"{key}: resolves to {value} ({how}), but it must be at least 1; "
                f"at world_size {ws} set {key} explicitly or make {TRAIN} larger"
            )
            return None
        if value > INT_MAX:
            problems.add(
                f"{key}: resolves to {value} ({how}), which is above {INT_MAX}; make the sizes smaller"
            )
            return None
    final = {TRAIN: t, MICRO: m, GAS: g} | {key: value for key, (value, _) in inferred.items()}
    t, m, g = final[TRAIN], final[MICRO], final[GAS]
    if t is None or m is None or g is None:  # unreachable: every branch above completes the triad
        raise RuntimeError(f"batch triad left incomplete: {final}")
    if t != m * g * ws:
        how = "".join(f"; {key} was inferred as {value} ({text})" for key, (value, text) in inferred.items())
        problems.add(
            f"{TRAIN}: batch sizes do not add up: {TRAIN} {t} != micro {m} * gas {g} * world_size {ws} "
            f"(= {m * g * ws}){how}; micro = {MICRO}, gas = {GAS}"
        )
        return None
    return BatchSizes(train=t, micro=m, gas=g)
