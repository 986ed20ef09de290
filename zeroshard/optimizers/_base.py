"""The step loop shared by zeroshard's own optimizers: closure handling, then one update per param group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class GroupwiseOptimizer(torch.optim.Optimizer):
    """An optimizer whose subclasses only say how one param group is updated (``_step_group``)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one update of every parameter that has a gradient.

        Args:
            closure: Optional callable that re-evaluates the model and returns the loss.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError
