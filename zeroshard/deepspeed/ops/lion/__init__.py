"""``deepspeed.ops.lion``: ``DeepSpeedCPULion`` and ``FusedLion`` with DeepSpeed's signatures.

Both are :class:`zeroshard.optimizers.Lion` (the same update, in PyTorch), run wherever the engine keeps
the master shard. accelerate builds ``DeepSpeedCPULion`` in place of a bitsandbytes 32-bit Lion when the
optimizer is offloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from zeroshard.deepspeed import surface
from zeroshard.optimizers import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


class DeepSpeedCPULion(Lion):
    """DeepSpeed's CPU Lion. ``fp32_optimizer_states`` is accepted: the momentum follows the fp32 master
    shard it steps."""

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0,
        fp32_optimizer_states: bool = True,
        adamw_mode: bool = False,
    ) -> None:
        # accelerate passes adamw_mode=False to every CPU optimizer it swaps in (see ops/adagrad.py).
        if adamw_mode:
            raise ValueError("DeepSpeedCPULion(adamw_mode=True): Lion has no AdamW mode")
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's fused CUDA Lion. ``set_grad_none`` is accepted: the engine owns the gradients."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
