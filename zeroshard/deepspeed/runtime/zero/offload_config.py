"""``deepspeed.runtime.zero.offload_config``: the offload enums and the two offload config blocks.

``OffloadDeviceEnum`` and ``OffloadStateTypeEnum`` have DeepSpeed's members and values (string enums, so
``OffloadDeviceEnum.cpu == "cpu"``); they are what ``engine.offload_states`` takes (``state_offload.py``).
The config classes are zeroshard's own blocks for ``zero_optimization.offload_param`` and
``offload_optimizer`` (the same fields, defaults and validation as DeepSpeed's; ``device`` is a plain
string equal to the enum member) with DeepSpeed's constructor: ``strict=False`` first, then the fields by
keyword.
"""

from __future__ import annotations

from zeroshard.config.blocks import OffloadOptimizerConfig, OffloadParamConfig
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime._models import MUTABLE, DeepSpeedModel
from zeroshard.runtime.state_offload import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]


class DeepSpeedZeroOffloadParamConfig(DeepSpeedModel, OffloadParamConfig):
    """``zero_optimization.offload_param`` (zeroshard's block, DeepSpeed's constructor)."""

    model_config = MUTABLE


class DeepSpeedZeroOffloadOptimizerConfig(DeepSpeedModel, OffloadOptimizerConfig):
    """``zero_optimization.offload_optimizer`` (zeroshard's block, DeepSpeed's constructor)."""

    model_config = MUTABLE

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: the NVMe swap is pipelined, reading or writing."""
        return self.pipeline_read or self.pipeline_write


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
