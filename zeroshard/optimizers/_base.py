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

    def _adam_moments(
        self, group: dict[str, Any]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[Any]]:
        """:func:`adam_moments` with step counts kept as ints."""
        return adam_moments(self, group, lambda p: 0)


def adam_moments(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], first_step: Callable[[torch.Tensor], Any]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[Any]]:
    """The group's parameters that have a gradient, with their gradients, first and second moments
    (created as zeros on first use, the step count as ``first_step(param)``) and step counts, each count
    advanced by one: what an Adam-family update reads. Raises ``RuntimeError`` on a sparse gradient."""
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{type(optimizer).__name__} does not support sparse gradients")
        state = optimizer.state[p]
        if not state:
            state["step"] = first_step(p)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        params.append(p)
        grads.append(p.grad)
        exp_avgs.append(state["exp_avg"])
        exp_avg_sqs.append(state["exp_avg_sq"])
        steps.append(state["step"])
    return params, grads, exp_avgs, exp_avg_sqs, steps
