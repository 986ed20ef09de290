"""DeepSpeed's warmup schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch.optim import Optimizer

from zeroshard.config.params import (
    check_choice,
    check_int,
    check_number,
)
from zeroshard.lr_schedules.base import _IterationSchedule, _lr_value, _per_group

log = logging.getLogger(__name__)

_SECTION = "scheduler.params"


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
        warmup_type: "log" or "linear"; any other value warns and uses "log", as DeepSpeed does.
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
        self.warmup_type = _warmup_type(warmup_type)
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
        self.warmup_type = _warmup_type(warmup_type)
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

    def get_lr_ratio(self) -> float:
        """DeepSpeed's ``get_lr_ratio``: the factor on each group's initial lr at
        :attr:`last_batch_iteration` (0 before the first step)."""
        return 0.0 if self.last_batch_iteration < 0 else self._ratio(self.last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self.warmup_min_ratio + _warmup_fraction(self, iteration) * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)


def _warmup_type(value: object) -> str:
    """``warmup_type`` as the schedules use it: "log" or "linear"; another string warns and gives "log",
    as DeepSpeed does."""
    if value in ("log", "linear"):
        return str(value)
    if not isinstance(value, str):
        check_choice(f"{_SECTION}.warmup_type", value, ("log", "linear"))  # raises, naming the choices
    log.warning("%s.warmup_type %r is not 'log' or 'linear': using 'log', as DeepSpeed does", _SECTION, value)
    return "log"


def _warmup_fraction(schedule: WarmupLR | WarmupCosineLR, iteration: int) -> float:
    """Return the warmup curve at ``iteration``: log(i + 1) / log(W), or i / W."""
    if schedule.warmup_type == "log":
        return schedule.inverse_log_warm_up * math.log(iteration + 1)
    return iteration / schedule.warmup_num_steps
