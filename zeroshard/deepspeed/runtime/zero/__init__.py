"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ZeRO-3 construction and gathering, and
``unwrap_model_for_generation``."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime.zero import partition_parameters
from zeroshard.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
)
from zeroshard.deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from zeroshard.deepspeed.utils.z3_leaf_module import set_z3_leaf_modules

__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "partition_parameters",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "unwrap_model_for_generation",
]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
