"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*``: one parameter's full value, whatever the stage.

A trained parameter's fp32 value lives in the master shards the optimizer steps, split over the ranks (over
the shard group with hybrid sharding); these functions assemble (or write) one parameter's whole value.
``safe_get_full_grad`` / ``safe_set_full_grad`` do the same for the gradient the engine holds between
``backward`` and ``step``, and ``safe_get_full_optimizer_state`` / ``safe_set_full_optimizer_state`` for one
optimizer state (``"exp_avg"``, ``"exp_avg_sq"``, ...) of the slices the optimizer steps.

The getters are collective: call on all ranks with the same parameter (the value is gathered from every
rank's shard). The ``safe_set_full_*`` setters of gradients and optimizer state write this rank's pieces of
the value it is given and communicate nothing, as DeepSpeed's (give every rank the same value);
``safe_set_full_fp32_param`` is collective (rank 0's value is kept).

The ``safe_*_local_*`` functions read and write this rank's part of a ZeRO-3 parameter only, with no
communication: the elements of the parameter in this rank's shard of its unit, 1-D, the same elements as
``param.ds_tensor`` ([Note: flat layout] in core/layout.py; empty where the shard holds none of the
parameter). As in DeepSpeed they are for ZeRO stage 3; elsewhere they raise ``ValueError``.

A frozen parameter (``requires_grad=False``) has no master, gradient or optimizer state: the getters return
``None`` for it and the setters change nothing, as DeepSpeed's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.export import gather_param_from_shards
from zeroshard.core.flat_param import FlatUnit
from zeroshard.deepspeed import surface
from zeroshard.zero import GatheredParameters, TrainedParameters, owner_of

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _unit_and_index(param: nn.Parameter, what: str) -> tuple[FlatUnit, int, TrainedParameters] | None:
    """The unit holding ``param``, its index there and its engine's parameters; None for a frozen one."""
    owner = owner_of(param)
    if owner is None and not param.requires_grad:
        return None  # frozen: trained by no unit, as DeepSpeed maps no master to it
    if owner is None:
        raise ValueError(
            f"{what}: the parameter (shape {tuple(param.shape)}) is not trained by a zeroshard engine; "
            "pass a parameter of the model given to deepspeed.initialize"
        )
    unit, trained = owner
    index = next(i for i, p in enumerate(unit.params) if p is param)
    return unit, index, trained


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's full fp32 (master) value, shaped like the parameter. Collective: all ranks."""
    if (found := _unit_and_index(param, "safe_get_full_fp32_param")) is None:
        return None
    unit, index, trained = found
    flat = gather_param_from_shards(trained.shard, unit, index, unit.master, "export")
    return flat.reshape(unit.shapes[index]).clone()


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (the whole parameter) the parameter's value on every rank, masters included.

    Rank 0's ``value`` is the one kept, written through ``GatheredParameters(param, modifier_rank=0)``; it
    passes through the parameter's dtype, so under bf16/fp16 the master gets the rounded value.
    Collective: all ranks.
    """
    if (found := _unit_and_index(param, "safe_set_full_fp32_param")) is None:
        return
    unit, index, _ = found
    _flat_value(unit, index, value, "safe_set_full_fp32_param")  # checks the shape
    with GatheredParameters([param], modifier_rank=0), torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


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
    if (found := _unit_and_index(param, "safe_get_full_grad")) is None:
        return None
    unit, index, trained = found
    shape = unit.shapes[index]
    whole = _whole_grad(unit)
    if whole is not None:
        lo, hi = unit.param_range(index)
        return whole[lo:hi].reshape(shape).clone()
    return gather_param_from_shards(trained.shard, unit, index, unit.grad_shard, "gradient").reshape(shape)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make ``value`` (the whole gradient, shaped like the parameter) the gradient the engine holds, where
    :func:`safe_get_full_grad` reads it: ``param.grad`` when set, else this rank's part of the engine's
    buffer (give every rank the same value). Local."""
    if param.grad is not None:
        param.grad.copy_(value)
        return
    if (found := _unit_and_index(param, "safe_set_full_grad")) is None:
        return
    unit, index, _ = found
    flat = _flat_value(unit, index, value, "safe_set_full_grad")
    unit.grad_written()
    whole = _whole_grad(unit)
    if whole is not None:
        lo, hi = unit.param_range(index)
        whole[lo:hi].copy_(flat)
        return
    piece = unit.layout.piece(unit.rank, index)
    if piece is not None:
        span = slice(piece.param_start, piece.param_start + piece.numel)
        unit.grad_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(flat[span])


def _whole_grad(unit: FlatUnit) -> torch.Tensor | None:
    """The unit's gradient where this rank holds it whole (unsharded, or not reduced yet), else None."""
    if unit.grad_full is not None and (unit.layout.world_size == 1 or not unit.grad_reduced):
        return unit.grad_full
    return None


def _flat_value(unit: FlatUnit, index: int, value: torch.Tensor, what: str) -> torch.Tensor:
    if tuple(value.shape) != tuple(unit.shapes[index]):
        raise ValueError(
            f"{what}({unit.names[index]}): value has shape {tuple(value.shape)}, the parameter "
            f"{tuple(unit.shapes[index])}"
        )
    return value.detach().reshape(-1)


def _states(
    trained: TrainedParameters, unit: FlatUnit, index: int, key: str, what: str
) -> tuple[list[Any], torch.dtype]:
    """This rank's pieces of the parameter with their ``key`` state tensors (1-D, like the pieces), and the
    state's dtype (read the same way on every rank, also one holding no piece)."""
    name = f"{what}({unit.names[index]}, {key!r})"
    opt = trained.optimizer
    if opt is None:
        raise ValueError(f"{name}: the engine has no optimizer")
    if not opt.state:
        raise ValueError(f"{name}: the optimizer has no state yet (it is created by the first step)")
    # Decided from the optimizer's state as a whole, the same on every rank (a rank holding no piece of this
    # parameter must refuse too, or the others would wait for it in the gather).
    some = next(iter(opt.state.values()))
    keys = sorted(k for k, v in some.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    if key not in keys:
        raise ValueError(f"{name}: no such per-element state; this optimizer keeps {keys}")
    if not some[key].numel():
        raise ValueError(
            f"{name}: the optimizer state is not in memory (offload_optimizer nvme keeps it in files)"
        )
    pieces = [(sl, opt.state[sl.master][key]) for sl in trained.slices.get(id(unit.params[index]), [])]
    return pieces, some[key].dtype


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The parameter's whole optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``), shaped like the
    parameter, in the state's dtype. Collective: all ranks.

    Raises:
        ValueError: no optimizer, no state before the first step, or a key the optimizer does not keep per
            element (naming the keys it does).
    """
    if (found := _unit_and_index(param, "safe_get_full_optimizer_state")) is None:
        return None
    unit, index, trained = found
    pieces, dtype = _states(trained, unit, index, optim_state_key, "safe_get_full_optimizer_state")
    shard = torch.zeros(unit.layout.shard_size, dtype=dtype, device=unit.master.device)
    for sl, tensor in pieces:
        shard[sl.piece.shard_start : sl.piece.shard_start + sl.piece.numel].copy_(tensor.reshape(-1))
    flat = gather_param_from_shards(trained.shard, unit, index, shard, "optimizer state")
    return flat.reshape(unit.shapes[index]).clone()


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write ``value`` (shaped like the parameter) into this rank's pieces of the optimizer state
    ``optim_state_key``; give every rank the same value. Local."""
    if (found := _unit_and_index(param, "safe_set_full_optimizer_state")) is None:
        return
    unit, index, trained = found
    flat = _flat_value(unit, index, value, "safe_set_full_optimizer_state")
    for sl, tensor in _states(trained, unit, index, optim_state_key, "safe_set_full_optimizer_state")[0]:
        start = sl.piece.param_start
        tensor.copy_(flat[start : start + sl.piece.numel].reshape(tensor.shape))


def safe_update_full_grad_vectorized(
    param_list: Sequence[nn.Parameter], update_func: Callable[[torch.Tensor, nn.Parameter], torch.Tensor]
) -> None:
    """Replace each parameter's whole gradient by ``update_func(gradient, param)``, where
    :func:`safe_get_full_grad` reads it and :func:`safe_set_full_grad` writes it (frozen parameters are
    skipped). Collective: all ranks, with the same parameters in the same order."""
    for param in param_list:
        if param.grad is not None:
            param.grad.copy_(update_func(param.grad, param))
        elif param.requires_grad:
            grad = safe_get_full_grad(param)
            if grad is not None:
                safe_set_full_grad(param, update_func(grad, param))


# --- this rank's part of a ZeRO-3 parameter -------------------------------------------------------------


def _local(param: nn.Parameter, what: str) -> tuple[FlatUnit, int, TrainedParameters, slice] | None:
    """``_unit_and_index`` and the parameter's elements in this rank's shard, as a slice of the shard
    (empty where the shard holds none); ``ValueError`` unless the parameter is sharded (ZeRO stage 3)."""
    if (found := _unit_and_index(param, what)) is None:
        return None
    unit, index, trained = found
    if trained.gatherer is None:  # only a stage-3 engine gathers parameters
        raise ValueError(
            f"{what}({unit.names[index]}): the local APIs read a ZeRO-3 parameter's shard, and this engine "
            f"runs ZeRO stage {unit.plan.stage}; use the safe_get_full_* / safe_set_full_* functions"
        )
    piece = unit.layout.piece(unit.rank, index)
    span = slice(0, 0) if piece is None else slice(piece.shard_start, piece.shard_start + piece.numel)
    return unit, index, trained, span


def _local_value(unit: FlatUnit, index: int, span: slice, value: torch.Tensor, what: str) -> torch.Tensor:
    numel = span.stop - span.start
    if value.numel() != numel:
        raise ValueError(
            f"{what}({unit.names[index]}): value has {value.numel()} elements, this rank's part of the "
            f"parameter {numel} (the shape of param.ds_tensor)"
        )
    return value.detach().reshape(-1)


def _local_master(unit: FlatUnit, index: int, span: slice, what: str) -> torch.Tensor:
    master = unit.store.master_piece(unit, span.start, span.stop - span.start)
    if master.numel() != span.stop - span.start:
        raise ValueError(
            f"{what}({unit.names[index]}): the master is not in memory (offload_optimizer nvme keeps it in "
            "files between steps)"
        )
    return master


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """A copy of this rank's part of the parameter's fp32 master (1-D, like ``param.ds_tensor``). Local."""
    if (found := _local(param, "safe_get_local_fp32_param")) is None:
        return None
    unit, index, _, span = found
    return _local_master(unit, index, span, "safe_get_local_fp32_param").clone()


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` (this rank's part, as :func:`safe_get_local_fp32_param` returns it) into the master
    and the parameter shard gathered from it. Local: each rank writes its own part."""
    if (found := _local(param, "safe_set_local_fp32_param")) is None:
        return
    unit, index, _, span = found
    flat = _local_value(unit, index, span, value, "safe_set_local_fp32_param")
    _local_master(unit, index, span, "safe_set_local_fp32_param").copy_(flat)
    unit.master_to_full()


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """A copy of this rank's part of the parameter's gradient (1-D, the accumulation dtype), as
    :func:`safe_get_full_grad` describes the gradient. Local."""
    if (found := _local(param, "safe_get_local_grad")) is None:
        return None
    unit, _, _, span = found
    return _grad_part(unit, span).clone()


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` into this rank's part of the parameter's gradient (see :func:`safe_get_local_grad`).
    Local."""
    if (found := _local(param, "safe_set_local_grad")) is None:
        return
    unit, index, _, span = found
    flat = _local_value(unit, index, span, value, "safe_set_local_grad")
    unit.grad_written()
    _grad_part(unit, span).copy_(flat)


def _grad_part(unit: FlatUnit, span: slice) -> torch.Tensor:
    """The gradient of shard elements ``span``: in the whole gradient while it is not reduced yet."""
    whole = _whole_grad(unit)
    if whole is None:
        return unit.grad_shard[span]
    lo, _ = unit.layout.shard_range(unit.rank)
    return whole[lo + span.start : lo + span.stop]


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """A copy of this rank's part of the parameter's optimizer state ``optim_state_key`` (1-D). Local."""
    if (found := _local(param, "safe_get_local_optimizer_state")) is None:
        return None
    unit, index, trained, span = found
    pieces, dtype = _states(trained, unit, index, optim_state_key, "safe_get_local_optimizer_state")
    out = torch.empty(span.stop - span.start, dtype=dtype, device=unit.master.device)
    for sl, tensor in pieces:
        start = sl.piece.shard_start - span.start
        out[start : start + sl.piece.numel].copy_(tensor.reshape(-1))
    return out


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write ``value`` into this rank's part of the optimizer state ``optim_state_key``. Local."""
    if (found := _local(param, "safe_set_local_optimizer_state")) is None:
        return
    unit, index, trained, span = found
    flat = _local_value(unit, index, span, value, "safe_set_local_optimizer_state")
    for sl, tensor in _states(trained, unit, index, optim_state_key, "safe_set_local_optimizer_state")[0]:
        start = sl.piece.shard_start - span.start
        tensor.copy_(flat[start : start + sl.piece.numel].reshape(tensor.shape))


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
