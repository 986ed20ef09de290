"""``deepspeed.runtime.zero.offload_config``: the offload enums and the two offload config blocks.

``OffloadDeviceEnum`` and ``OffloadStateTypeEnum`` have DeepSpeed's members and values (string enums, so
``OffloadDeviceEnum.cpu == "cpu"``); they are what ``engine.offload_states`` takes (``state_offload.py``).
The config classes are zeroshard's own blocks for ``zero_optimization.offload_param`` and
``offload_optimizer`` (the same fields, defaults and validation as DeepSpeed's; ``device`` is a plain
string equal to the enum member) with DeepSpeed's constructor: ``strict=False`` first, then the fields by
keyword.
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.blocks import OffloadOptimizerConfig, OffloadParamConfig
from zeroshard.deepspeed import surface
from zeroshard.runtime.state_offload import OffloadDeviceEnum, OffloadStateTypeEnum

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]


def _lenient(strict: bool, data: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's config models, unless ``strict``, take a field given as ``"auto"`` as not given."""
    return data if strict else {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}


class DeepSpeedZeroOffloadParamConfig(OffloadParamConfig):
    """``zero_optimization.offload_param`` (zeroshard's block, DeepSpeed's constructor)."""

    def __init__(self, strict: bool = False, **data: Any) -> None:
        super().__init__(**_lenient(strict, data))


class DeepSpeedZeroOffloadOptimizerConfig(OffloadOptimizerConfig):
    """``zero_optimization.offload_optimizer`` (zeroshard's block, DeepSpeed's constructor)."""

    def __init__(self, strict: bool = False, **data: Any) -> None:
        super().__init__(**_lenient(strict, data))


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
