"""Resolving "auto" values from what `initialize()` knows.

[Note: auto] The rules, also in docs/config.md:
- train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps: "auto" counts as not
  given and the batch triad infers it from the other two and the world size (`batch.py`); when they
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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.config.batch import TRIAD
from zeroshard.config.errors import Problems

__all__ = ["AutoContext", "is_auto", "resolve_auto"]


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
