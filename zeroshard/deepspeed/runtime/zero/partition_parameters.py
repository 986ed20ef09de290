"""``deepspeed.runtime.zero.partition_parameters``: ``Init``, ``GatheredParameters``, ``ZeroParamStatus``.

Also the two constructor-wrapping names transformers reaches for around ``zero.Init``
(``prevent_arange_dtype_change`` swaps ``zero_wrapper_for_fp_tensor_constructor`` out and back, and
compares with ``_orig_torch_arange``). zeroshard's ``Init`` wraps no tensor constructor (tensors are built
as torch builds them, then each submodule's parameters are cut to this rank's slice), so swapping the
wrapper changes nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from zeroshard.core.marks import register_external_parameter
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.zero import GatheredParameters, Init

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "get_accelerator",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]

_orig_torch_arange = torch.arange


class ZeroParamStatus(Enum):
    """DeepSpeed's stage-3 parameter states (the values of ``param.ds_status``, see docs/porting.md)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype | None, target_device: torch.device | None
) -> Callable[..., torch.Tensor]:
    """``fn`` with ``device=target_device`` when the call names none, and floating results cast to
    ``target_fp_dtype`` (DeepSpeed's wrapper; unused by zeroshard's ``Init``, see the module docstring)."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped
