"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, ``ZeroParamStatus``."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from zeroshard.core.marks import register_external_parameter
from zeroshard.zero import GatheredParameters, Init

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


class ZeroParamStatus(Enum):
    """DeepSpeed's stage-3 parameter states (the values of ``param.ds_status``, see docs/porting.md)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
