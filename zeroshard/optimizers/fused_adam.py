"""DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam``: DeepSpeed's signatures and defaults, torch's kernel.

[Note: DeepSpeed's Adam classes]
DeepSpeed compiles an Adam kernel per device (``FusedAdam`` on the GPU, ``DeepSpeedCPUAdam`` on the CPU);
both compute one update: AdamW unless ``adam_w_mode`` is false (then L2), moments bias-corrected unless
``bias_correction`` is false, weight decay 0 by default. Here both classes are ``torch.optim.Adam`` with
``fused=True`` and ``decoupled_weight_decay=adam_w_mode``, the kernel torch ships for CPU and CUDA (on the
CPU as fast as DeepSpeed's compiled one over the engine's shards, bench/cpu_adam.py). So an instance gives
exactly what ``torch.optim.AdamW(fused=True)`` (or ``Adam``) gives over the same tensors, and keeps the
same state (``step``, ``exp_avg``, ``exp_avg_sq``) and ``state_dict``. A parameter group with
``bias_correction`` false, which torch's kernel lacks, steps by
:func:`~zeroshard.optimizers.adam.adam_update` over that same state.

The engine builds ``FusedAdam`` for a config's ``"Adam"`` or ``"AdamW"`` (``DeepSpeedCPUAdam`` when the
optimizer is offloaded), as DeepSpeed does, so ``isinstance(optimizer, FusedAdam)`` holds as there; a
config that asks for torch's class (``torch_adam``) or a torch-only option (``amsgrad``, ``foreach``,
``maximize``, ...) gets torch's class (``optim_factory.py``). ``amsgrad=True`` is refused: DeepSpeed's
FusedAdam refuses it and its CPU Adam ignores it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from zeroshard.optimizers._base import adam_moments
from zeroshard.optimizers.adam import adam_update

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

Params = Iterable[Tensor] | Iterable[dict[str, Any]]


class _KernelAdam(torch.optim.Adam):
    """torch's fused Adam with DeepSpeed's ``bias_correction`` and ``adam_w_mode``.

    As in DeepSpeed, ``adam_w_mode`` and the kernel are the optimizer's, whatever the parameter groups say: a
    group taken from another optimizer (accelerate builds ``DeepSpeedCPUAdam(adamw.param_groups, ...)``)
    keeps its ``lr``, ``betas``, ``eps`` and ``weight_decay`` but is stepped by the fused kernel in this
    optimizer's weight-decay mode. A group asking for AMSGrad is refused (DeepSpeed's CPU Adam ignores it).
    """

    def __init__(
        self,
        params: Params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        adam_w_mode: bool,
        amsgrad: bool,
    ) -> None:
        self._kernel = {"bias_correction": bias_correction, "adam_w_mode": adam_w_mode}  # before the groups
        super().__init__(
            params,
            lr=lr,
            betas=(float(betas[0]), float(betas[1])),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            fused=True,
            decoupled_weight_decay=adam_w_mode,
        )
        self.defaults.update(self._kernel)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (also at construction), stepped by this optimizer's kernel and weight-decay mode."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group.get("amsgrad"):
            self.param_groups.pop()
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant, as in DeepSpeed")
        mode = self._kernel["adam_w_mode"]
        group.update(fused=True, foreach=None, capturable=False, differentiable=False)
        group.update(decoupled_weight_decay=mode, adam_w_mode=mode)
        group.setdefault("bias_correction", self._kernel["bias_correction"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every parameter that has a gradient (torch's fused kernel where bias-corrected)."""
        uncorrected = [g for g in self.param_groups if not g.get("bias_correction", True)]
        loss: float | None = None
        if not uncorrected:
            loss = super().step(closure)
            return loss
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        self.param_groups = [g for g in groups if g.get("bias_correction", True)]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = groups
        for group in uncorrected:
            self._step_uncorrected(group)
        return loss

    def _step_uncorrected(self, group: dict[str, Any]) -> None:
        # torch's Adam state (a float32 step count), so that either path can continue it.
        moments = adam_moments(self, group, lambda p: torch.zeros((), dtype=torch.float32, device=p.device))
        if moments[0]:
            adam_update(group, *moments, bias_correction=False)


class FusedAdam(_KernelAdam):
    """DeepSpeed's fused Adam (``deepspeed.ops.adam.FusedAdam``): AdamW by default (``adam_w_mode=True``).

    ``set_grad_none`` is accepted for DeepSpeed's signature; ``zero_grad()`` sets gradients to None by default
    as torch's optimizers do.
    """

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
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adam_w_mode,
            amsgrad=amsgrad,
        )


class DeepSpeedCPUAdam(_KernelAdam):
    """DeepSpeed's CPU Adam (``deepspeed.ops.adam.DeepSpeedCPUAdam``): AdamW by default (``adamw_mode=True``).

    ``fp32_optimizer_states`` is accepted for DeepSpeed's signature: the states follow the parameters' dtype,
    and the engine's are fp32 masters.
    """

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
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adam_w_mode=adamw_mode,
            amsgrad=amsgrad,
        )
