"""Filling in what a config leaves open: "auto" values, and the batch triad.

[Note: auto] The rules, also in docs/config.md:
- train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps: "auto" counts as not
  given and the batch triad infers it from the other two and the world size (`resolve_batch`); when they
  cannot, the error names the "auto" keys.
- fp16.enabled / bf16.enabled: true for the one matching the model's parameter dtype, else false.
- zero_optimization.reduce_bucket_size = hidden_size**2, stage3_prefetch_bucket_size =
  int(0.9 * hidden_size**2), stage3_param_persistence_threshold = 10 * hidden_size (the Hugging Face
  integration's rule) when the hidden size is known, else DeepSpeed's default.
- optimizer.params.*: copied from the client optimizer's `defaults` (lr, betas, eps, weight_decay, ...);
  without a client optimizer it is an error.
- scheduler.params.warmup_max_lr: the optimizer's lr; warmup_min_lr: 0; any other scheduler "auto"
  (total_num_steps, warmup_num_steps, ...) is an error, since only the training script knows it.
- optimizer.type / scheduler.type "auto" is an error.
- Any other "auto" in a typed block takes the field's default, as DeepSpeed's pydantic blocks do
  (`keys.drop_auto`); gradient_clipping "auto" therefore is DeepSpeed's default, 1.0.

[Note: batch triad] train_batch_size = micro * gradient_accumulation_steps * world_size. Mirrors
DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion`: any two of the three determine the
third (with integer division, as DeepSpeed does); with one of them given, gradient accumulation is 1;
gradient_accumulation_steps alone, or nothing, is an error. Every resolved value must be at least 1 and
the equation must hold exactly. "auto" counts as not given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.config.blocks import INT_MAX
from zeroshard.config.errors import Problems, show

__all__ = [
    "GAS",
    "MICRO",
    "TRAIN",
    "TRIAD",
    "AutoContext",
    "BatchSizes",
    "is_auto",
    "resolve_auto",
    "resolve_batch",
]


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


def is_auto(value: Any) -> bool:
    """Whether `value` is the string "auto"."""
    return isinstance(value, str) and value == "auto"


@dataclass(frozen=True)
class AutoContext:
    """What `initialize()` knows that a config's "auto" values may refer to.

    Attributes:
        world_size: Data-parallel world size.
        hidden_size: The model's hidden size, when known.
        model_dtype: Dtype of the model's floating-point parameters, when known.
        client_optimizer: The optimizer passed to `initialize()`, if any.
    """

    world_size: int
    hidden_size: int | None = None
    model_dtype: torch.dtype | None = None
    client_optimizer: torch.optim.Optimizer | None = None


def _plain(value: Any) -> Any:
    # Optimizer defaults may hold tensors (a tensor lr) or tuples (betas); the config keeps JSON values.
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value


def _optimizer(block: Mapping[str, Any], ctx: AutoContext, problems: Problems) -> dict[str, Any]:
    out = dict(block)
    if is_auto(out.get("type")):
        problems.add('optimizer.type: "auto" cannot be resolved; name the optimizer, e.g. "AdamW"')
    params = out.get("params")
    if not isinstance(params, Mapping):
        return out
    resolved = dict(params)
    client = ctx.client_optimizer
    for key, value in params.items():
        if not is_auto(value):
            continue
        path = f"optimizer.params.{key}"
        if client is None:
            problems.add(
                f'{path}: "auto" is copied from the client optimizer, but none was given; pass '
                f"optimizer= to initialize() or write a number"
            )
        elif key not in client.defaults:
            problems.add(
                f'{path}: "auto" cannot be resolved: the client optimizer {type(client).__name__} has no '
                f"default '{key}'; write a value"
            )
        else:
            resolved[key] = _plain(client.defaults[key])
    out["params"] = resolved
    return out


def _optimizer_lr(data: Mapping[str, Any], ctx: AutoContext) -> Any:
    optimizer = data.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(optimizer.get("params"), Mapping):
        lr = optimizer["params"].get("lr")
        if lr is not None and not is_auto(lr):
            return lr
    if ctx.client_optimizer is not None and "lr" in ctx.client_optimizer.defaults:
        return _plain(ctx.client_optimizer.defaults["lr"])
    return None


def _scheduler(data: Mapping[str, Any], ctx: AutoContext, problems: Problems) -> dict[str, Any]:
    out = dict(data["scheduler"])
    if is_auto(out.get("type")):
        problems.add('scheduler.type: "auto" cannot be resolved; name the scheduler, e.g. "WarmupLR"')
    params = out.get("params")
    if not isinstance(params, Mapping):
        return out
    resolved = dict(params)
    for key, value in params.items():
        if not is_auto(value):
            continue
        path = f"scheduler.params.{key}"
        if key == "warmup_min_lr":
            resolved[key] = 0
        elif key == "warmup_max_lr":
            lr = _optimizer_lr(data, ctx)
            if lr is None:
                problems.add(
                    f'{path}: "auto" takes the optimizer\'s lr, but there is none; set optimizer.params.lr '
                    f"or pass a client optimizer"
                )
            else:
                resolved[key] = lr
        else:
            problems.add(
                f'{path}: "auto" cannot be resolved: only the training script knows it (the Hugging Face '
                f"Trainer fills it from its arguments); write a number"
            )
    out["params"] = resolved
    return out


def _zero(block: Mapping[str, Any], hidden_size: int | None) -> dict[str, Any]:
    out = dict(block)
    if hidden_size is None:
        return out  # every "auto" here takes DeepSpeed's default (keys.drop_auto)
    rules = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in rules.items():
        if is_auto(out.get(key)):
            out[key] = value
    return out


def resolve_auto(
    data: Mapping[str, Any], ctx: AutoContext, problems: Problems
) -> tuple[dict[str, Any], dict[str, Any], frozenset[str]]:
    """Applies the rules of [Note: auto] to a canonical config (see `keys.canonicalize`).

    Returns:
        The config without the batch triad; the triad keys that were given with a value (not "auto");
        and the triad keys that were "auto".
    """
    out = dict(data)
    given: dict[str, Any] = {}
    auto: set[str] = set()
    for key in TRIAD:
        if key in out:
            value = out.pop(key)
            if is_auto(value):
                auto.add(key)
            else:
                given[key] = value
    for key, target in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        block = out.get(key)
        if isinstance(block, Mapping) and is_auto(block.get("enabled")):
            out[key] = {**block, "enabled": ctx.model_dtype == target}
    if isinstance(out.get("zero_optimization"), Mapping):
        out["zero_optimization"] = _zero(out["zero_optimization"], ctx.hidden_size)
    if isinstance(out.get("optimizer"), Mapping):
        out["optimizer"] = _optimizer(out["optimizer"], ctx, problems)
    if isinstance(out.get("scheduler"), Mapping):
        out["scheduler"] = _scheduler(out, ctx, problems)
    return out, given, frozenset(auto)
