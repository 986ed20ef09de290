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
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.optimizers._kwargs import (
    check_bool,
    check_choice,
    check_int,
    check_keys,
    check_number,
    check_value,
    resolve_name,
)

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

log = logging.getLogger(__name__)

_SECTION = "scheduler.params"


class _IterationSchedule(LRScheduler):
    """Base of the DeepSpeed schedules: a closed-form lr per iteration.

    See [Note: DeepSpeed's iteration counting].
    """

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int = -1) -> None:
        check_int(f"{_SECTION}.last_batch_iteration", last_batch_iteration, minimum=-1)
        if last_batch_iteration >= 0:
            for group in optimizer.param_groups:
                group.setdefault("initial_lr", group["lr"])
        super().__init__(optimizer, last_epoch=last_batch_iteration)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's iteration index of the lr now applied (-1 before the first step)."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float | Tensor]:
        """Return the lr of each param group at :attr:`last_batch_iteration`."""
        return list(self.lrs_at(self.last_batch_iteration))

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at DeepSpeed iteration ``iteration``."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Return torch's scheduler state plus DeepSpeed's ``last_batch_iteration``."""
        state = super().state_dict()
        state["last_batch_iteration"] = self.last_batch_iteration
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` or from a DeepSpeed scheduler's state dict."""
        state = dict(state_dict)
        iteration = state.pop("last_batch_iteration", None)
        if "last_epoch" not in state and iteration is not None:
            state["last_epoch"] = iteration + 1
        super().load_state_dict(state)


class WarmupLR(_IterationSchedule):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    At iteration ``i >= 0``: ``lr = min + (max - min) * gamma(i)``, where during warmup
    (``i < W``, ``W = max(2, warmup_num_steps)``) ``gamma = log(i + 1) / log(W)`` ("log") or
    ``i / W`` ("linear"), and ``gamma = 1`` after. At iteration -1 the lr is ``min``.

    Args:
        optimizer: The optimizer whose group lrs this sets.
        warmup_min_lr: Start lr, one number or one per param group.
        warmup_max_lr: Peak lr, one number or one per group; None (default) takes each group's
            current lr, as DeepSpeed does.
        warmup_num_steps: Warmup length, a positive int.
        warmup_type: "log" or "linear". DeepSpeed falls back to "log" for other values with a
            warning; zeroshard raises instead.
        last_batch_iteration: Iteration to resume from; -1 starts the schedule.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        groups = len(optimizer.param_groups)
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, groups)
        if warmup_max_lr is None:
            self.max_lrs = [_lr_value(group["lr"]) for group in optimizer.param_groups]
        else:
            self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, groups)
        self.delta_lrs = [high - low for high, low in zip(self.max_lrs, self.min_lrs, strict=True)]
        check_int(f"{_SECTION}.warmup_num_steps", warmup_num_steps, minimum=1)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = check_choice(f"{_SECTION}.warmup_type", warmup_type, ("log", "linear"))
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at ``iteration``."""
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + delta * gamma for low, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self, iteration)
        return 1.0


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``.

    After warmup, ``gamma = max(0, (T - i) / max(1, T - W))`` with ``T = total_num_steps``.
    ``warmup_max_lr`` defaults to 0.001 here, as in DeepSpeed.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        check_int(f"{_SECTION}.total_num_steps", total_num_steps, minimum=0)
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration
        )
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "%s.total_num_steps %d < warmup_num_steps %d", _SECTION, total_num_steps, warmup_num_steps
            )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self, iteration)
        span = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - iteration) / span)


class WarmupCosineLR(_IterationSchedule):
    """Warm up a ratio of each group's lr, then cosine-decay it to ``cos_min_ratio``.

    The ratio multiplies the group's lr at construction. At iteration -1 it is 0. During warmup
    (``i < W``): ``warmup_min_ratio + f(i) * (1 - warmup_min_ratio)`` with ``f`` as in
    :class:`WarmupLR`. After: with ``p = min(1, (i - W + 1) / max(1, T - W))``,
    ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        check_int(f"{_SECTION}.total_num_steps", total_num_steps, minimum=0)
        check_int(f"{_SECTION}.warmup_num_steps", warmup_num_steps, minimum=1)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = check_number(f"{_SECTION}.warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = check_number(f"{_SECTION}.cos_min_ratio", cos_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = check_choice(f"{_SECTION}.warmup_type", warmup_type, ("log", "linear"))
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if total_num_steps < self.warmup_num_steps:
            log.warning(
                "%s.total_num_steps %d < warmup_num_steps %d", _SECTION, total_num_steps, warmup_num_steps
            )
        self.org_lrs = [_lr_value(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at ``iteration``."""
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self._ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + _warmup_fraction(self, iteration) * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


class LRRangeTest(_IterationSchedule):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest stable lr.

    ``lr = min_lr * (1 + step_rate * n)`` with ``n = (i + 1) / step_size``, floored when
    ``lr_range_test_staircase`` is true.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.min_lrs = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, len(optimizer.param_groups))
        check_int(f"{_SECTION}.lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_size = lr_range_test_step_size
        self.step_rate = check_number(f"{_SECTION}.lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = check_bool(f"{_SECTION}.lr_range_test_staircase", lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at ``iteration``."""
        interval: float = float(iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1 + self.step_rate * interval
        return [lr * increase for lr in self.min_lrs]


class OneCycle(_IterationSchedule):
    """DeepSpeed's 1Cycle: lr up then down over one cycle, then optional decay; momentum inverse.

    With ``s1 = cycle_first_step_size``, ``s2 = cycle_second_step_size`` (default ``s1``) and
    ``S = s1 + s2``, iteration ``i < S`` uses a scale ``f`` of ``b = i + 1``: rising ``b / s1``
    over the first ``s1`` batches, then falling back to 0. A positive stair count holds ``f`` on
    ``floor(position * count) / count`` instead. ``lr = min + (max - min) * f`` and, when
    cycling momentum, ``beta1 = max_mom - (max_mom - min_mom) * f``. From ``i >= S`` with
    ``d = i - S + 1``: ``lr = min / (1 + decay_lr_rate * d / decay_step_size)`` and
    ``beta1 = max_mom * (1 + decay_mom_rate * d / decay_step_size)``, or ``min`` / ``max_mom``
    when ``decay_step_size`` or the rate is 0.

    As in DeepSpeed, construction sets every group's lr to ``cycle_min_lr`` and, when
    ``cycle_momentum``, its ``betas`` to ``(cycle_min_mom, 0.99)``; momentum cycles only for
    optimizers with ``betas`` (others log a warning and keep their momentum), and **beta2 is set
    to 0.99** whatever it was.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        # DeepSpeed takes these as floats, so 1e3 in JSON (a float) is fine.
        self.first_step_size = _positive("cycle_first_step_size", cycle_first_step_size)
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _positive("cycle_second_step_size", cycle_second_step_size)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = check_int(f"{_SECTION}.cycle_first_stair_count", cycle_first_stair_count)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else check_int(f"{_SECTION}.cycle_second_stair_count", cycle_second_stair_count)
        )
        self.decay_step_size = check_number(f"{_SECTION}.decay_step_size", decay_step_size)
        groups = len(optimizer.param_groups)
        self.min_lrs = [check_number(f"{_SECTION}.cycle_min_lr", cycle_min_lr)] * groups
        self.max_lrs = [check_number(f"{_SECTION}.cycle_max_lr", cycle_max_lr)] * groups
        self.decay_lr_rate = check_number(f"{_SECTION}.decay_lr_rate", decay_lr_rate)
        self.decay_mom_rate = check_number(f"{_SECTION}.decay_mom_rate", decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_mom = check_number(f"{_SECTION}.cycle_min_mom", cycle_min_mom)
        self.max_mom = check_number(f"{_SECTION}.cycle_max_mom", cycle_max_mom)
        self.cycle_momentum = check_bool(f"{_SECTION}.cycle_momentum", cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            log.warning(
                "%s.cycle_momentum: disabled because %s has no 'betas' (as in DeepSpeed)",
                _SECTION,
                type(optimizer).__name__,
            )
            self.cycle_momentum = False
        if self.cycle_momentum and any(group["betas"][1] != 0.99 for group in optimizer.param_groups):
            log.warning("%s: OneCycle sets beta2 to 0.99 in every param group (as DeepSpeed does)", _SECTION)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self) -> list[float | Tensor]:
        """Return the lr of each group at :attr:`last_batch_iteration`; also set its momentum."""
        if self.cycle_momentum:
            beta1 = self.momentum_at(self.last_batch_iteration)
            for group in self.optimizer.param_groups:
                group["betas"] = (beta1, 0.99)
        return super().get_lr()

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at ``iteration``."""
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momentum_at(self, iteration: int) -> float:
        """Return beta1 at ``iteration`` (``cycle_min_mom`` at -1, as DeepSpeed's constructor sets)."""
        if iteration < 0:
            return self.min_mom
        if iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale(iteration)
        if self.skip_mom_decay:
            return self.max_mom
        return self.max_mom * (
            1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        )

    def _scale(self, iteration: int) -> float:
        """Return the cycle position scale in [0, 1] for ``iteration`` (< ``total_size``)."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            # Quantise from the integer batch offset, not from `scale`, which can land a hair
            # under an exact stair at a half-cycle boundary.
            offset = batch % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale


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


def _warmup_fraction(schedule: WarmupLR | WarmupCosineLR, iteration: int) -> float:
    """Return the warmup curve at ``iteration``: log(i + 1) / log(W), or i / W."""
    if schedule.warmup_type == "log":
        return schedule.inverse_log_warm_up * math.log(iteration + 1)
    return iteration / schedule.warmup_num_steps


def _lr_value(lr: float | Tensor) -> float:
    """Return a group's lr as a float (torch allows a one-element tensor)."""
    return lr.item() if isinstance(lr, Tensor) else float(lr)


def _positive(key: str, value: object) -> float:
    """Return ``value`` as a float if it is a number > 0; raise naming ``scheduler.params.<key>``."""
    number = float(check_number(f"{_SECTION}.{key}", value))
    if number <= 0:
        raise ValueError(f"{_SECTION}.{key}: expected a number > 0, got {value!r}")
    return number


def _per_group(key: str, value: object, groups: int) -> list[float]:
    """Return ``value`` as one number per param group (a number is repeated)."""
    if isinstance(value, list | tuple):
        if len(value) != groups:
            raise ValueError(
                f"{_SECTION}.{key}: expected {groups} values (one per param group), got {len(value)}"
            )
        return [check_number(f"{_SECTION}.{key}[{index}]", item) for index, item in enumerate(value)]
    return [check_number(f"{_SECTION}.{key}", value)] * groups
