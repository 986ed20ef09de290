"""The iteration-counted base of DeepSpeed's LR schedules and small shared helpers."""

from __future__ import annotations

import logging
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.config.params import (
    check_int,
    check_number,
)

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

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Apply the lr of the next iteration, or of ``last_batch_iteration`` when given (DeepSpeed's
        signature: ``engine.step(lr_kwargs={"last_batch_iteration": k})`` jumps the schedule to k).

        Raises:
            TypeError, ValueError: ``last_batch_iteration`` is not an integer >= -1.
        """
        if last_batch_iteration is not None:
            check_int("scheduler.step(last_batch_iteration)", last_batch_iteration, minimum=-1)
            self.last_epoch = last_batch_iteration  # torch's step adds one: last_epoch - 1 == the iteration
        super().step()

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


def _lr_value(lr: float | Tensor) -> float:
    """Return a group's lr as a float (torch allows a one-element tensor)."""
    return lr.item() if isinstance(lr, Tensor) else float(lr)


def _positive(key: str, value: object) -> float:
    """Return ``value`` as a float if it is a number > 0; raise naming ``scheduler.params.<key>``."""
    number = float(check_number(f"{_SECTION}.{key}", value))
    if number <= 0:
        raise ValueError(f"{_SECTION}.{key}: expected a number > 0, got {value!r}")
    return number


def _non_negative(key: str, value: object) -> float:
    """Return ``value`` as a float if it is a number >= 0; raise naming ``scheduler.params.<key>``."""
    number = float(check_number(f"{_SECTION}.{key}", value))
    if number < 0:
        raise ValueError(f"{_SECTION}.{key}: expected a number >= 0, got {value!r}")
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
