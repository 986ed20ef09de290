"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, ``ZeroParamStatus``,
and DeepSpeed's attributes on the parameters an engine trains at stage 3 ([Note: DeepSpeed parameter
attributes] in core/ds_attrs.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.core.ds_attrs import ZeroParamStatus, ds_id, present
from zeroshard.core.stage3.module_marks import register_external_parameter
from zeroshard.deepspeed import surface
from zeroshard.zero import GatheredParameters, Init

if TYPE_CHECKING:
    from zeroshard.runtime.engine import ZeroshardEngine

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

# torch's own arange, as imported: transformers' ``prevent_arange_dtype_change`` compares against it.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: Any
) -> Callable[..., torch.Tensor]:
    """``fn`` made to place its tensor on ``target_device`` (unless given a device) and cast floating results
    to ``target_fp_dtype``.

    DeepSpeed's ``zero.Init`` swaps torch's tensor constructors for such wrappers; transformers replaces this
    function around ``from_pretrained`` to spare ``torch.arange``. zeroshard's ``Init`` swaps no constructor
    (it casts parameters, not every tensor, when it partitions them), so replacing this function changes
    nothing there; it is kept for code that calls or patches it.
    """

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    return wrapped


def _mark_stage3_params(engine: ZeroshardEngine) -> None:
    """Present DeepSpeed's attributes on the parameters ``engine`` trains at ZeRO stage 3 (nothing at 0-2).

    A parameter keeps the ``ds_id`` it has (``zero.Init`` gave it one); the others get the next ids, in
    ``module.parameters()`` order, as DeepSpeed numbers a model built outside ``zero.Init``. For a parameter
    in a unit, ``partition_numel()`` counts its elements in this rank's slice of the unit
    ([Note: flat layout] in core/layout.py; 0 where the slice holds none of it), ``ds_tensor`` is those
    elements of the master shard (the fp32 tensor the optimizer steps, so always current; with the
    optimizer on NVMe, the swapper's placeholder, empty between its uses). ``ds_status`` is
    ``NOT_AVAILABLE`` outside ``GatheredParameters`` blocks ([Note: DeepSpeed parameter attributes] says
    why), but always ``AVAILABLE`` for a persistent unit (``stage3_param_persistence_threshold``), which is
    full on every rank. Frozen parameters belong to no unit: every rank holds them whole, so they say
    ``AVAILABLE`` and ``ds_tensor`` is the whole (flattened) parameter.
    """
    if not engine.plan.shard_parameters:
        return
    for param in engine.module.parameters():
        ds_id(param)
    in_units: set[int] = set()
    for unit in engine.units:
        pieces = {piece.index: piece for piece in unit.layout.pieces(unit.rank)}
        for i, (param, shape) in enumerate(zip(unit.params, unit.shapes, strict=True)):
            piece = pieces.get(i)
            if piece is None:
                shard = torch.empty(0, dtype=unit.master.dtype, device=unit.master.device)
            else:
                shard = unit.store.master_piece(unit, piece.shard_start, piece.numel)
            held = 0 if piece is None else piece.numel
            present(param, shape, shard, available=not unit.plan.shard_parameters, held=held)
            in_units.add(id(param))
    for param in engine.module.parameters():
        if id(param) not in in_units:
            present(param, param.shape, param.detach().reshape(-1), available=True)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
