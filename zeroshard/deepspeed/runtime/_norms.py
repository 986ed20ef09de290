"""The norm helpers of ``deepspeed.runtime.utils`` (which re-exports them): DeepSpeed's arithmetic, float32
round trips included, on one data-parallel group ([Note: mpu means model parallelism] in ``utils.py``)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from zeroshard.deepspeed import comm
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.refusals import refuse

_PIPE_REPLICATED = "ds_pipe_replicated"  # DeepSpeed's PIPE_REPLICATED: a pipeline stage's replicated copy


def _refuse_mpu(mpu: Any, name: str) -> None:
    """[Note: mpu means model parallelism]."""
    if mpu is not None:
        refuse(f"deepspeed.runtime.utils.{name}(mpu=...)", "model parallelism (an mpu)")


def _float32(value: float) -> float:
    """``value`` rounded to float32, as DeepSpeed's one-element ``FloatTensor`` round trip rounds it."""
    return float(torch.tensor(value, dtype=torch.float32).item())


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds a NaN or an infinity, as a boolean scalar tensor on ``x``'s device (no host sync).

    Two reductions decide it (``amax`` carries NaN and +inf, ``amin`` -inf); an empty tensor holds neither;
    of a sparse tensor only the stored values count.
    """
    values = x._values() if x.is_sparse else x
    if values.numel() == 0:
        return torch.tensor(False, device=values.device)
    return ~(torch.isfinite(values.amax()) & torch.isfinite(values.amin()))


def is_invalid_grad_norm(norm: Any) -> bool:
    """Whether a norm (tensor or number) is infinite, NaN or negative (DeepSpeed's -1 marks a bad norm)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list: Iterable[Any]) -> float:
    """The 2-norm of a list of norms, ``sqrt(sum(n ** 2))``; ``inf`` when any of them is invalid
    (:func:`is_invalid_grad_norm`)."""
    norms = list(norm_list)
    if any(is_invalid_grad_norm(n) for n in norms):
        return float("inf")
    total: Any = 0.0
    for n in norms:
        total += n**2.0
    return math.sqrt(total)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total ``norm_type``-norm is at most
    ``max_norm``; return that norm (before clipping) as a float32 scalar tensor.

    As DeepSpeed's: the norm is this rank's, then averaged over the data-parallel group (the world), and the
    scale is ``min(1, max_norm / (norm + 1e-6))``. ``mpu`` must be ``None`` ([Note: mpu means model
    parallelism]). Parameters without a gradient are skipped; at least one must have one.

    Collective: call on all ranks of the world group.
    """
    _refuse_mpu(mpu, "clip_grad_norm_")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [g.detach() for p in params if (g := p.grad) is not None]
    norm_type = float(norm_type)
    device = get_accelerator().current_device_name()
    if norm_type == math.inf:
        total = torch.stack([g.abs().max().float() for g in grads]).max().to(device)
    else:
        norms = [g.float().norm(norm_type) for g in grads]
        summed = torch.stack(norms).pow(norm_type).sum().float() if norms else torch.zeros(1)
        total = summed.to(device).pow(1.0 / norm_type)
    # Averaged over the data-parallel group, as DeepSpeed does for MoE parameters' rank-local norms.
    total = total * 1.0 / float(comm.get_world_size())
    if comm.is_initialized():
        comm.all_reduce(total)
    total = total.to(grads[0].device)  # IndexError without gradients, as DeepSpeed's
    max_norm_t = torch.tensor(float(max_norm), device=total.device)
    scale = torch.clamp(max_norm_t / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)
    return total


def get_grad_zeros(parameters: Any, mpu: Any = None) -> float:
    """How many gradient elements of ``parameters`` are zero (a float, as DeepSpeed's float32 count);
    pipeline-replicated copies are not counted. ``mpu`` must be ``None``."""
    _refuse_mpu(mpu, "get_grad_zeros")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    zeros = 0.0
    for p in params:
        if p.grad is None or getattr(p, _PIPE_REPLICATED, False):
            continue
        zeros += (p.grad.numel() - torch.count_nonzero(p.grad)).item()
    return _float32(zeros)


def get_weight_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The total ``norm_type``-norm of the values of ``parameters`` (a float; -1 when it is infinite or NaN);
    pipeline-replicated copies are not counted. ``mpu`` must be ``None``."""
    _refuse_mpu(mpu, "get_weight_norm")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = _float32(float(max(p.detach().abs().max() for p in params)))
    else:
        powers: Any = 0.0
        for p in params:
            if not getattr(p, _PIPE_REPLICATED, False):
                powers += p.detach().float().norm(norm_type) ** norm_type
        total = _float32(float(powers)) ** (1.0 / norm_type)
    return -1 if math.isinf(total) or math.isnan(total) else total
