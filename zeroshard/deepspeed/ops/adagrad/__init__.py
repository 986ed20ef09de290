"""``deepspeed.ops.adagrad``: ``DeepSpeedCPUAdagrad`` with DeepSpeed's signature, as ``torch.optim.Adagrad``.

DeepSpeed's CPU kernel takes the same step as ``torch.optim.Adagrad`` with ``lr_decay=0`` and
``initial_accumulator_value=0``: ``g += weight_decay * p``; ``sum += g * g``; ``p -= lr * g / (sqrt(sum) +
eps)``. accelerate builds it in place of a ``torch.optim.Adagrad`` when the optimizer is offloaded, from
that optimizer's param groups (whose own ``lr_decay``/``initial_accumulator_value`` then apply).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.deepspeed import surface

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad (elementwise, so exact on shards at every stage)."""

    def __init__(
        self,
        model_params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        adamw_mode: bool = False,
    ) -> None:
        # accelerate passes adamw_mode=False to every CPU optimizer it swaps in (DeepSpeed's Adagrad has no
        # such argument, so there the swap fails): accepted when False, as it means plain Adagrad.
        if amsgrad or adamw_mode:
            raise ValueError(
                f"DeepSpeedCPUAdagrad(amsgrad={amsgrad}, adamw_mode={adamw_mode}): "
                "Adagrad has neither variant"
            )
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
