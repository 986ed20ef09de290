"""Adam / AdamW with DeepSpeed FusedAdam's knobs, notably ``bias_correction``.

torch.optim.Adam and AdamW always bias-correct the moments; DeepSpeed configs may say
``"bias_correction": false``. This optimizer follows DeepSpeed's FusedAdam update, written with
``torch._foreach`` ops so it runs on any device. Every operation is elementwise, so stepping a
shard of a parameter gives the same values as stepping the whole parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.optimizers._base import GroupwiseOptimizer

__all__ = ["DeepSpeedAdam", "adam_update"]


class DeepSpeedAdam(GroupwiseOptimizer):
    """Adam with optional bias correction and L2 or decoupled weight decay.

    Per step, for each parameter ``p`` with gradient ``g`` (``t`` counts this parameter's steps)::

        g = g + weight_decay * p                     # only when adam_w_mode is False (L2)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        c1, c2 = (1 - beta1**t, 1 - beta2**t) if bias_correction else (1, 1)
        update = (m / c1) / (sqrt(v / c2) + eps)
        update = update + weight_decay * p           # only when adam_w_mode is True (AdamW)
        p = p - lr * update

    Parameters whose ``.grad`` is None are skipped: no state is created or changed for them.

    Args:
        params: Parameters or parameter groups, as for any torch optimizer.
        lr: Learning rate.
        betas: Decay rates of the first and second moment averages.
        eps: Added to the denominator.
        weight_decay: Weight decay coefficient (L2 or decoupled, see ``adam_w_mode``).
        bias_correction: Divide the moments by ``1 - beta**t``.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 penalty (Adam) when False.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = self._adam_moments(group)
        if params:
            adam_update(
                group, params, grads, exp_avgs, exp_avg_sqs, steps, bias_correction=group["bias_correction"]
            )


def adam_update(
    group: dict[str, Any],
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Any],
    *,
    bias_correction: bool,
) -> None:
    """One :class:`DeepSpeedAdam` update of ``params`` in place (the formula in its docstring), with the
    group's ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``adam_w_mode``; ``steps`` already counts this
    step (read only with ``bias_correction``). Call under ``torch.no_grad()``."""
    beta1, beta2 = group["betas"]
    lr = _as_float(group["lr"])
    weight_decay = group["weight_decay"]
    decoupled = group["adam_w_mode"]

    if weight_decay != 0.0 and not decoupled:
        grads = list(torch._foreach_add(grads, params, alpha=weight_decay))
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

    if bias_correction:
        numerators = list(torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in steps]))
        denominators = list(torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in steps]))
        torch._foreach_sqrt_(denominators)
    else:
        numerators = exp_avgs
        denominators = list(torch._foreach_sqrt(exp_avg_sqs))
    torch._foreach_add_(denominators, group["eps"])
    updates = torch._foreach_div(numerators, denominators)
    if weight_decay != 0.0 and decoupled:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


def _as_float(value: float | Tensor) -> float:
    """Return a Python float for a learning rate given as a float or a one-element tensor."""
    return value.item() if isinstance(value, Tensor) else float(value)
