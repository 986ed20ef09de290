"""DeepSpeed's cyclic schedules: LRRangeTest and OneCycle."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from torch import Tensor
from torch.optim import Optimizer

from zeroshard.config.params import (
    check_bool,
    check_int,
    check_number,
)
from zeroshard.lr_schedules.base import _IterationSchedule, _non_negative, _per_group, _positive

log = logging.getLogger(__name__)

_SECTION = "scheduler.params"


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
    to 0.99** whatever it was. ``cycle_min_lr``, ``cycle_max_lr``, ``cycle_min_mom`` and
    ``cycle_max_mom`` take one number or one per param group; ``cycle_second_step_size`` may be 0
    (the cycle only rises). ``get_mom()`` is each group's ``betas`` for the current iteration.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: float = 2000,
        cycle_second_step_size: float | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        # DeepSpeed takes these as floats, so 1e3 in JSON (a float) is fine.
        self.first_step_size = _positive("cycle_first_step_size", cycle_first_step_size)
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _non_negative("cycle_second_step_size", cycle_second_step_size)
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
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, groups)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, groups)
        self.decay_lr_rate = check_number(f"{_SECTION}.decay_lr_rate", decay_lr_rate)
        self.decay_mom_rate = check_number(f"{_SECTION}.decay_mom_rate", decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.min_moms = _per_group("cycle_min_mom", cycle_min_mom, groups)
        self.max_moms = _per_group("cycle_max_mom", cycle_max_mom, groups)
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
            momenta = self.momenta_at(self.last_batch_iteration)
            for group, beta1 in zip(self.optimizer.param_groups, momenta, strict=True):
                group["betas"] = (beta1, 0.99)
        return super().get_lr()

    def get_mom(self) -> list[tuple[float, float]] | None:
        """DeepSpeed's ``get_mom``: each group's ``(beta1, 0.99)`` at :attr:`last_batch_iteration` by the
        cycle's formula (at -1 the cycle's start, ``cycle_max_mom``), None without ``cycle_momentum``."""
        if not self.cycle_momentum:
            return None
        return [(beta1, 0.99) for beta1 in self._momenta(self.last_batch_iteration)]

    def lrs_at(self, iteration: int) -> list[float]:
        """Return the lr of each param group at ``iteration``."""
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """Return each group's beta1 at ``iteration`` (``cycle_min_mom`` at -1, as DeepSpeed's constructor
        sets)."""
        return list(self.min_moms) if iteration < 0 else self._momenta(iteration)

    def _momenta(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            bounds = zip(self.min_moms, self.max_moms, strict=True)
            return [high - (high - low) * scale for low, high in bounds]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [high * factor for high in self.max_moms]

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
