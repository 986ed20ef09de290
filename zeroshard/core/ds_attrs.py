"""DeepSpeed's ZeRO-3 parameter attributes, presented on the parameters as a mirror of zeroshard's state.

[Note: DeepSpeed parameter attributes]
Code written for DeepSpeed reads what DeepSpeed sets on every ZeRO-3 parameter: ``ds_shape`` and
``ds_numel`` (the full parameter's), ``ds_id`` (unique in the process), ``ds_status`` (a
:class:`ZeroParamStatus`), ``ds_tensor`` (this rank's shard) and ``partition_numel()`` (the shard's size).
PEFT and DeepSpeed-Chat size LoRA matrices from ``ds_shape``, TRL and DeepSpeed-Chat gather the parameters
whose ``ds_status`` is ``NOT_AVAILABLE``, Lightning's model summary counts ``partition_numel()``.

zeroshard presents these attributes but keeps none of its state in them: the owner holds it
([Note: parameter owners] in owners.py), ``zero.Init``'s partition map before ``initialize`` and the engine's
units after, and the owner rewrites the attributes when its state changes. They mirror, they do not own:
nothing in zeroshard reads them back, except ``ds_id``, which is given once and kept, as DeepSpeed keeps it.

Invariants, for a parameter that carries them:

* ``ds_status`` is ``AVAILABLE`` only while the parameter may be used as it is: ``param.data`` holds the
  full value, and saving the parameter for backward keeps the parameter. That is inside
  ``GatheredParameters``, and always for a parameter every rank holds whole (at stage 3: persistent and
  frozen ones). Elsewhere it is ``NOT_AVAILABLE``, also while a module's forward has gathered its
  parameters: zeroshard's saved-tensor hooks ([Note: saved views]) would hand backward a view of the
  gathered buffer in place of a parameter saved there, and code that trusts ``AVAILABLE`` saves the
  parameter without gathering it (TRL's fused LM-head loss does, then reads ``ds_status`` of what backward
  gets). ``NOT_AVAILABLE`` is always safe: such code gathers, and gathering a gathered unit moves no data.
  ``INFLIGHT`` is never shown.
* ``ds_tensor`` is the owner's own tensor, never a copy, so it is current without being rewritten, and
  ``partition_numel() == ds_tensor.numel()`` (but for a master kept on NVMe: see ``_mark_stage3_params``).
* ``ds_shape`` / ``ds_numel`` are the full parameter's; ``ds_id`` numbers parameters in the order they were
  first presented, from 0, one counter per process (DeepSpeed's ``Init.param_id``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable
from enum import Enum

import torch
from torch import nn

__all__ = ["ZeroParamStatus", "ds_id", "present", "set_available", "withdraw"]


class ZeroParamStatus(Enum):
    """DeepSpeed's stage-3 parameter states: the values of ``param.ds_status``."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


# The process's ds_id counter, as DeepSpeed's (a class attribute of its zero.Init): every rank presents the
# same parameters in the same order (building a model under zero.Init is collective in effect), so the ids
# agree across ranks.
_NEXT_ID = itertools.count()

# The attributes that describe an owner's current state (the rest are facts about the parameter).
_STATE = ("ds_status", "ds_tensor", "partition_numel")


def ds_id(param: nn.Parameter) -> int:
    """``param``'s ``ds_id``: the one it carries, else the next of the process's counter (and now carries)."""
    current = getattr(param, "ds_id", None)
    if isinstance(current, int):
        return current
    new = next(_NEXT_ID)
    param.ds_id = new  # type: ignore[attr-defined]
    return new


def present(
    param: nn.Parameter, shape: torch.Size, shard: torch.Tensor, *, available: bool, held: int | None = None
) -> None:
    """Present DeepSpeed's attributes on ``param``: full ``shape``, this rank's ``shard`` (the owner's own
    1-D tensor, which ``ds_tensor`` then is), whether ``param.data`` holds the full value now, and how many
    elements this rank holds (``held``, by default ``shard.numel()``; what ``partition_numel()`` returns)."""
    ds_id(param)
    values = {
        "ds_shape": torch.Size(shape),
        "ds_numel": torch.Size(shape).numel(),
        "ds_tensor": shard,
        "partition_numel": functools.partial(int, shard.numel() if held is None else held),
    }
    for name, value in values.items():
        setattr(param, name, value)
    set_available([param], available)


def set_available(params: Iterable[nn.Parameter], available: bool) -> None:
    """Set ``ds_status`` of those ``params`` that carry DeepSpeed's attributes (the others stay bare)."""
    status = ZeroParamStatus.AVAILABLE if available else ZeroParamStatus.NOT_AVAILABLE
    for param in params:
        if hasattr(param, "ds_tensor"):
            param.ds_status = status  # type: ignore[attr-defined]


def withdraw(param: nn.Parameter) -> None:
    """Drop the attributes that describe an owner's state (``ds_status``, ``ds_tensor``,
    ``partition_numel``) when that owner lets the parameter go; ``ds_shape``, ``ds_numel`` and ``ds_id``
    stay, being true of the parameter whoever holds it."""
    for name in _STATE:
        if name in vars(param):
            delattr(param, name)
