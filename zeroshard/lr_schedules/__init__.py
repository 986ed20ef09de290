"""DeepSpeed's LR schedules as torch LRSchedulers, and the factory for a ds_config ``scheduler``.

[Note: DeepSpeed's iteration counting]
DeepSpeed's schedulers count ``last_batch_iteration`` from -1: construction applies the lr of
iteration -1, and the k-th ``step()`` applies the lr of iteration k-1. torch's LRScheduler counts
``last_epoch`` and its constructor already steps once, to 0. Here
``last_epoch == last_batch_iteration + 1``, so the optimizer holds DeepSpeed's lr before the
first optimizer step and after every scheduler step. Resuming with ``last_batch_iteration = L``
sets the lr of iteration L at construction (DeepSpeed leaves the optimizer's lr alone until the
next step); ``load_state_dict`` also accepts DeepSpeed's ``{"last_batch_iteration": L}``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.config.params import (
    check_bool,
    check_int,
    check_keys,
    check_number,
    check_value,
    resolve_name,
)
from zeroshard.lr_schedules.base import _IterationSchedule
from zeroshard.lr_schedules.cycle import LRRangeTest, OneCycle
from zeroshard.lr_schedules.warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

log = logging.getLogger(__name__)

_SECTION = "scheduler.params"


_DEEPSPEED_SCHEDULES: dict[str, type[_IterationSchedule]] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupCosineLR": WarmupCosineLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupLR": WarmupLR,
}

#: torch schedulers that a JSON config cannot drive, with the reason.
_TORCH_REFUSED = {
    "LambdaLR": "it needs a Python callable (lr_lambda), which JSON cannot express",
    "MultiplicativeLR": "it needs a Python callable (lr_lambda), which JSON cannot express",
    "SequentialLR": "it needs scheduler objects, which JSON cannot express",
    "ChainedScheduler": "it needs scheduler objects, which JSON cannot express",
    "ReduceLROnPlateau": "its step() needs a metric, and the engine steps schedulers without one",
    "LRScheduler": "it is the abstract base class",
}


def build_scheduler(type_name: str, params: Mapping[str, Any], optimizer: Optimizer) -> LRScheduler:
    """Build the scheduler for ``{"scheduler": {"type": type_name, "params": params}}``.

    DeepSpeed's schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
    reproduce DeepSpeed's lr sequence (see [Note: DeepSpeed's iteration counting]); any other
    name is a class of ``torch.optim.lr_scheduler`` called with ``params`` as keyword args.
    Names match case-insensitively.

    Args:
        type_name: ``scheduler.type``.
        params: ``scheduler.params``.
        optimizer: The optimizer whose param-group lrs the scheduler sets.

    Returns:
        The scheduler; constructing it has already set the optimizer's lrs for the first step.

    Raises:
        TypeError: A value has the wrong type.
        ValueError: Unknown or unusable type, unknown key (with did-you-mean and the accepted
            keys), a missing required key, or a value out of range; messages name
            ``scheduler.type`` or ``scheduler.params.<key>``.
    """
    torch_names = [
        name
        for name, obj in vars(torch.optim.lr_scheduler).items()
        if isinstance(obj, type) and issubclass(obj, LRScheduler) and not name.startswith("_")
    ]
    usable = sorted({*_DEEPSPEED_SCHEDULES, *torch_names} - set(_TORCH_REFUSED))
    name = resolve_name(
        "scheduler.type", type_name, {*_DEEPSPEED_SCHEDULES, *torch_names}, "scheduler", shown=usable
    )
    if name in _TORCH_REFUSED:
        raise ValueError(
            f"scheduler.type: {name!r} cannot be built from a config: {_TORCH_REFUSED[name]}. "
            f"Available: {', '.join(usable)}."
        )
    cls = _DEEPSPEED_SCHEDULES.get(name) or getattr(torch.optim.lr_scheduler, name)
    signature = inspect.signature(cls)
    accepted = {key: p for key, p in signature.parameters.items() if key != "optimizer"}
    owner = f"{cls.__module__}.{cls.__qualname__}"
    check_keys(_SECTION, params, accepted, owner)
    for key, parameter in accepted.items():
        if parameter.default is inspect.Parameter.empty and key not in params:
            raise ValueError(f"{_SECTION}.{key}: required by scheduler {name!r} but missing")
    if name in _DEEPSPEED_SCHEDULES:
        return cls(optimizer, **params)  # validates its own values, naming scheduler.params.<key>
    kwargs = {key: _check_torch_value(key, value, accepted[key]) for key, value in params.items()}
    try:
        return cls(optimizer, **kwargs)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{_SECTION}: {owner} rejected {kwargs}: {error}") from error


def _check_torch_value(key: str, value: Any, parameter: inspect.Parameter) -> Any:
    """Check a torch scheduler argument by its annotation (or default) when that is a plain type.

    Compound annotations (lists, callables, literals) are left to the constructor.
    """
    path = f"{_SECTION}.{key}"
    annotation = str(parameter.annotation)
    if annotation == "int":
        return check_int(path, value)
    if annotation == "float":
        return check_number(path, value)
    if annotation == "bool":
        return check_bool(path, value)
    if any(word in annotation for word in ("list", "Sequence", "Iterable", "Callable", "Literal")):
        return value
    return check_value(path, value, parameter.default)
