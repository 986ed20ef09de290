"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures.

Both are :class:`zeroshard.optimizers.DeepSpeedAdam` (the same update, in PyTorch): DeepSpeed's CPU and CUDA
kernels compute that update on their device; here it runs wherever the engine keeps the master shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from zeroshard.deepspeed import surface
from zeroshard.optimizers import DeepSpeedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


def _no_amsgrad(owner: str, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(f"{owner}(amsgrad=True) is not supported (DeepSpeed does not support it either)")


class DeepSpeedCPUAdam(DeepSpeedAdam):
    """DeepSpeed's CPU Adam: AdamW by default (``adamw_mode=True``), bias correction on."""

    def __init__(
        self,
        model_params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _no_amsgrad("DeepSpeedCPUAdam", amsgrad)
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adamw_mode,
        )


class FusedAdam(DeepSpeedAdam):
    """DeepSpeed's fused CUDA Adam: AdamW by default (``adam_w_mode=True``)."""

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _no_amsgrad("FusedAdam", amsgrad)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
        )


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
