"""``deepspeed.runtime.zero.config``: ``DeepSpeedZeroConfig``, the ``zero_optimization`` block.

It is zeroshard's own block (``zeroshard.config.blocks.ZeroConfig``: the same fields, defaults and value
checks the engine reads) with DeepSpeed's constructor and conventions, so a config built here reads as in
DeepSpeed:

- the deprecated keys are read as DeepSpeed reads them, with a warning each (``cpu_offload``,
  ``cpu_offload_param``, ``cpu_offload_use_pin_memory``, ``stage3_gather_fp16_weights_on_model_save``:
  ``zeroshard/config/deprecated.py``) and the ``stage3_`` spellings are aliases of their fields;
- ``offload_param`` and ``offload_optimizer`` are None unless given (the engine's config holds a block with
  device ``"none"`` instead), and their blocks are DeepSpeed's classes (``offload_config.py``);
- ``overlap_comm`` left out is True at stage 3 and False below;
- ``"auto"`` values are dropped unless ``strict=True``, and fields can be assigned (validated).

Problems with the deprecated keys raise ``ConfigError`` (a ``ValueError`` and DeepSpeed's
``DeepSpeedConfigError``); wrong values and unknown keys raise pydantic's ``ValidationError``, as there.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from zeroshard.config.blocks import ZeroConfig
from zeroshard.config.deprecated import DEPRECATED_ZERO_KEYS, apply_deprecations
from zeroshard.config.errors import Problems
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime._models import MUTABLE, DeepSpeedModel, lenient
from zeroshard.deepspeed.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)
from zeroshard.deepspeed.utils.logging import logger

__all__ = ["DeepSpeedZeroConfig", "ZeroStageEnum", "get_zero_config"]


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's names for the stages (ints: ``ZeroStageEnum.weights == 3``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedZeroConfig(DeepSpeedModel, ZeroConfig):
    """``zero_optimization`` with DeepSpeed's constructor: ``strict`` first, then the keys (see the module
    docstring)."""

    model_config = MUTABLE

    offload_param: DeepSpeedZeroOffloadParamConfig | None = None  # type: ignore[assignment]
    """Parameter offload (stage 3); None unless given."""
    offload_optimizer: DeepSpeedZeroOffloadOptimizerConfig | None = None  # type: ignore[assignment]
    """Optimizer-state offload; None unless given."""

    def __init__(self, strict: bool = False, **data: Any) -> None:
        super().__init__(strict=True, **_current_keys(lenient(strict, data)))

    @model_validator(mode="after")
    def _warn_elastic_checkpoint(self) -> DeepSpeedZeroConfig:
        if self.stage == 3 and self.elastic_checkpoint:
            logger.warning(
                "ZeRO-3 elastic checkpointing is deprecated and not supported: zeroshard's checkpoints "
                "resume at any world size without it"
            )
        return self


def _signature() -> inspect.Signature:
    """The keywords DeepSpeed's class takes: the fields, then the old spellings (``stage3_`` aliases and the
    deprecated keys); ``overlap_comm`` defaults to None (resolved by the stage), as there."""
    own = inspect.signature(DeepSpeedZeroConfig)
    params = [p.replace(default=None) if p.name == "overlap_comm" else p for p in own.parameters.values()]
    defaults = {alias: own.parameters[name].default for alias, name in ZeroConfig.input_aliases.items()}
    defaults |= {key: False if key.startswith("stage3_") else None for key in DEPRECATED_ZERO_KEYS}
    keyword = inspect.Parameter.KEYWORD_ONLY
    params += [inspect.Parameter(key, keyword, default=default) for key, default in defaults.items()]
    return own.replace(parameters=params)


DeepSpeedZeroConfig.__signature__ = _signature()


def _rewritten(ds_config: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """``ds_config`` with DeepSpeed's deprecated keys rewritten (``config/deprecated.py``), one warning
    each; their problems raised as one ``ConfigError`` naming ``origin``."""
    notes: list[str] = []
    problems = Problems()
    current = apply_deprecations(ds_config, notes, problems)
    problems.raise_if_any(origin)
    for note in notes:
        logger.warning(note)
    return current


def _current_keys(zero: Mapping[str, Any]) -> dict[str, Any]:
    """``zero`` with DeepSpeed's deprecated keys rewritten and aliases renamed."""
    current = _rewritten({"zero_optimization": dict(zero)}, "DeepSpeedZeroConfig")["zero_optimization"]
    return {ZeroConfig.input_aliases.get(key, key): value for key, value in current.items()}


def get_zero_config(param_dict: Mapping[str, Any]) -> DeepSpeedZeroConfig:
    """The ``zero_optimization`` block of the ds_config ``param_dict`` (also its old ``true``/``false``
    form), as :class:`DeepSpeedZeroConfig`."""
    return DeepSpeedZeroConfig(**_rewritten(param_dict, "ds_config").get("zero_optimization", {}))


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
