"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*``: one parameter's full value, whatever the stage.

A trained parameter's fp32 value lives in the master shards the optimizer steps, split over the ranks;
these functions assemble (or write) one parameter's whole value. ``safe_get_full_grad`` assembles the
gradient the same way (it lives in the engine between ``backward`` and ``step``). Optimizer states are kept
per shard: reading them through a parameter is not supported, and says so (use ``engine.save_checkpoint``
/ ``zeroshard.checkpoint``).

Collective: call on all ranks with the same parameter (the value is gathered from every rank's shard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.export import gather_param_from_shards
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.deepspeed import surface
from zeroshard.zero import GatheredParameters, owner_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]


def _unit_and_index(param: nn.Parameter, what: str) -> tuple[FlatUnit, int, Comm]:
    owner = owner_of(param)
    if owner is None:
        raise ValueError(
            f"{what}: the parameter (shape {tuple(param.shape)}) is not trained by a zeroshard engine; "
            "pass a parameter of the model given to deepspeed.initialize"
        )
    unit, _, comm = owner
    if unit.layout.world_size not in (1, comm.world_size):
        raise NotImplementedError(
            f"{what} is not supported with hybrid sharding (zero_optimization.mics_shard_size "
            f"{unit.layout.world_size} of {comm.world_size} ranks): use engine.full_state_dict() or a "
            "checkpoint"
        )
    index = next(i for i, p in enumerate(unit.params) if p is param)
    return unit, index, comm


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """The parameter's full fp32 (master) value, shaped like the parameter. Collective: all ranks."""
    unit, index, comm = _unit_and_index(param, "safe_get_full_fp32_param")
    flat = gather_param_from_shards(comm, unit, index, unit.master, "export")
    return flat.reshape(unit.shapes[index]).clone()


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor:
    """DeepSpeed's per-rank fragment accessor: here the full value (see ``safe_get_full_fp32_param``)."""
    return safe_get_full_fp32_param(param)


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (the whole parameter) the parameter's value on every rank, masters included.

    Rank 0's ``value`` is the one kept, written through ``GatheredParameters(param, modifier_rank=0)``; it
    passes through the parameter's dtype, so under bf16/fp16 the master gets the rounded value.
    Collective: all ranks.
    """
    unit, index, _ = _unit_and_index(param, "safe_set_full_fp32_param")
    if tuple(value.shape) != tuple(unit.shapes[index]):
        raise ValueError(
            f"safe_set_full_fp32_param({unit.names[index]}): value has shape {tuple(value.shape)}, "
            f"the parameter {tuple(unit.shapes[index])}"
        )
    with GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


def _refuse(what: str) -> Any:
    raise NotImplementedError(
        f"{what} is not supported by zeroshard: optimizer states are kept per shard; read them from a "
        "checkpoint (engine.save_checkpoint, "
        "zeroshard.checkpoint.get_fp32_state_dict) instead"
    )


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's whole gradient as the engine holds it between ``backward`` and ``step``.

    ``param.grad`` when a backward this engine did not run left one there. Otherwise the engine's
    accumulated gradient, in its accumulation dtype (fp32 unless ``data_types.grad_accum_dtype`` says
    otherwise), still multiplied by the fp16 loss scale, divided by ``gradient_accumulation_steps``: the
    average over ranks once it has been reduced (at stages 2-3 after every backward, at stages 0-1 from the
    boundary's backward on), this rank's own sum before that (as DeepSpeed's ``param.grad`` at stages
    0-1). Where the engine keeps only shards, the other ranks' pieces are gathered for this call only; a
    new tensor is returned. Zeros after ``step()`` (which clears the gradients). Collective: all ranks.
    """
    if param.grad is not None:
        return param.grad
    unit, index, comm = _unit_and_index(param, "safe_get_full_grad")
    shape = unit.shapes[index]
    if unit.grad_full is not None and (unit.layout.world_size == 1 or not unit.grad_reduced):
        lo, hi = unit.param_range(index)
        return unit.grad_full[lo:hi].reshape(shape).clone()
    return gather_param_from_shards(comm, unit, index, unit.grad_shard, "gradient").reshape(shape)


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """Not supported (see the module docstring): raises ``NotImplementedError`` naming it."""
    return _refuse("safe_get_full_optimizer_state")  # type: ignore[no-any-return]


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Not supported (see the module docstring): raises ``NotImplementedError`` naming it."""
    _refuse("safe_set_full_optimizer_state")


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
