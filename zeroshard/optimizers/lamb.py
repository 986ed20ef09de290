"""LAMB with DeepSpeed FusedLamb's semantics.

LAMB scales each parameter's Adam-style update by a trust ratio ``||p|| / ||update||``. Those
norms are over the *whole* parameter, so this optimizer is exact only when every tensor it is
given is a whole parameter (flattened is fine: a norm does not depend on shape). A ZeRO shard
that holds part of a parameter would get a different trust ratio; :mod:`zeroshard.optim_factory`
therefore refuses LAMB at stages that split parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.optimizers._base import GroupwiseOptimizer
from zeroshard.optimizers.adam import _as_float

__all__ = ["Lamb"]


class Lamb(GroupwiseOptimizer):
    """LAMB: Adam moments, trust-ratio-scaled update per parameter.

    Per step, for each parameter ``p`` with gradient ``g`` (``t`` counts this parameter's steps)::

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        c1, c2 = (1 - beta1**t, 1 - beta2**t) if bias_correction else (1, 1)
        denom = sqrt(v / c2 + eps) if eps_inside_sqrt else sqrt(v / c2) + eps
        update = (m / c1) / denom + weight_decay * p
        w, u = norm(p), norm(update)
        coeff = clamp(w / u, min_coeff, max_coeff) if w > 0 and u > 0 else 1
        p = p - lr * coeff * update

    This is DeepSpeed's FusedLamb kernel (moments bias-corrected before the trust ratio, as in
    the LAMB paper's Algorithm 2). Parameters whose ``.grad`` is None are skipped.

    Args:
        params: Parameters or parameter groups; each tensor must be a whole parameter.
        lr: Learning rate.
        betas: Decay rates of the first and second moment averages.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay, included in the update before the trust ratio.
        bias_correction: Divide the moments by ``1 - beta**t``.
        max_coeff: Upper bound of the trust ratio.
        min_coeff: Lower bound of the trust ratio.
        eps_inside_sqrt: Add ``eps`` under the square root instead of after it.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        eps_inside_sqrt: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                f"need 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, max_coeff={max_coeff}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        super().__init__(params, defaults)

    def _step_group(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = self._adam_moments(group)
        if not params:
            return
        beta1, beta2 = group["betas"]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        if group["bias_correction"]:
            numerators = list(torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in steps]))
            denominators = list(torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in steps]))
        else:
            numerators = exp_avgs
            denominators = [v.clone() for v in exp_avg_sqs]
        if group["eps_inside_sqrt"]:
            torch._foreach_add_(denominators, group["eps"])
            torch._foreach_sqrt_(denominators)
        else:
            torch._foreach_sqrt_(denominators)
            torch._foreach_add_(denominators, group["eps"])
        updates = torch._foreach_div(numerators, denominators)
        if group["weight_decay"] != 0.0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])

        # Trust ratios stay on device (no .item()), so this adds no host sync per parameter.
        coeffs = [
            _trust_ratio(w, u, group["min_coeff"], group["max_coeff"])
            for w, u in zip(torch._foreach_norm(params), torch._foreach_norm(updates), strict=True)
        ]
        torch._foreach_mul_(updates, coeffs)
        torch._foreach_add_(params, updates, alpha=-_as_float(group["lr"]))


def _trust_ratio(weight_norm: Tensor, update_norm: Tensor, min_coeff: float, max_coeff: float) -> Tensor:
    """Return ``clamp(w / u, min, max)``, or 1 where either norm is zero (0-dim tensor)."""
    ratio = (weight_norm / update_norm).clamp(min_coeff, max_coeff)
    usable = (weight_norm > 0) & (update_norm > 0)
    return torch.where(usable, ratio, torch.ones_like(ratio))
