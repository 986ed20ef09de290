"""Dtype policy: which dtype each kind of tensor is held and communicated in (``zeroshard.core_config``
builds it from the config, following the rules below).

[Note: dtype vocabulary]
*compute dtype*: the full parameters the model computes with (and their gradients from autograd): fp32, or
bf16/fp16 under mixed precision. *master dtype*: the shard the optimizer steps, always fp32. When it equals
the compute dtype at stages 0-2, the master shard is a view of the full parameters, so fp32 training holds
no second copy. *reduce dtype*: gradients travel between ranks in it (``communication_data_type``, default
the compute dtype, as in DeepSpeed). *accumulation dtype*: the kept gradients (full or shard) are summed
over micro-steps in it (``data_types.grad_accum_dtype``). Its default is fp32 when there is accumulation
(gradient_accumulation_steps > 1) so that summing many 16-bit micro-gradients does not lose precision, and
the compute dtype otherwise, where nothing is accumulated and 16-bit gradients give the paper's 2N bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DtypePolicy:
    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    accumulate: torch.dtype = torch.float32

    @property
    def master_is_compute(self) -> bool:
        return self.compute == self.master

    @property
    def mixed(self) -> bool:
        return self.compute != torch.float32


FP32 = DtypePolicy()


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj
