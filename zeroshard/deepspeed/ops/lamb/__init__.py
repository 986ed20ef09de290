"""``deepspeed.ops.lamb``: ``FusedLamb`` with DeepSpeed's signature, as :class:`zeroshard.optimizers.Lamb`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from zeroshard.deepspeed import surface
from zeroshard.optimizers import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """DeepSpeed's fused LAMB. ``max_grad_norm`` must be 0: gradient clipping is the config's
    ``gradient_clipping``, applied by the engine before the step."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "FusedLamb(amsgrad=True) is not supported (DeepSpeed does not support it either)"
            )
        if max_grad_norm:
            raise ValueError(
                f"FusedLamb(max_grad_norm={max_grad_norm}) is not supported: set the config's "
                "gradient_clipping instead"
            )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            eps_inside_sqrt=eps_inside_sqrt,
        )


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
