"""Lion (EvoLved Sign Momentum) with DeepSpeed FusedLion's defaults.

Elementwise, so stepping a shard of a parameter gives the same values as stepping the whole
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.optimizers._base import GroupwiseOptimizer
from zeroshard.optimizers.adam import _as_float

__all__ = ["Lion"]


class Lion(GroupwiseOptimizer):
    """Lion: a sign update of an interpolated momentum.

    Per step, for each parameter ``p`` with gradient ``g``::

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    ``sign(0)`` is 0 (``torch.sign``, as in the Lion paper), so an exactly-zero ``c`` moves ``p``
    by weight decay only; DeepSpeed's CPU kernel steps by ``-lr`` there instead. Parameters
    whose ``.grad`` is None are skipped.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate (DeepSpeed's default 1e-3).
        betas: Interpolation and momentum decay rates.
        weight_decay: Decoupled weight decay coefficient.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        lr = _as_float(group["lr"])
        if group["weight_decay"] != 0.0:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        directions = torch._foreach_mul(exp_avgs, beta1)
        torch._foreach_add_(directions, grads, alpha=1.0 - beta1)
        torch._foreach_sign_(directions)
        torch._foreach_add_(params, directions, alpha=-lr)
        torch._foreach_mul_(exp_avgs, beta2)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
