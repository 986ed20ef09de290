"""``deepspeed.runtime.precision_config``: the ``bf16`` and ``fp16`` blocks as DeepSpeed's config models.

``DeepSpeedBF16Config`` and ``DeepSpeedFP16Config`` are zeroshard's blocks (``zeroshard.config.blocks``: the
fields, defaults and value checks the engine reads) with DeepSpeed's constructor and assignment
(``_models.py``). ``get_bfloat16_config`` reads ``bf16``, else the old spelling ``bfloat16``;
``get_float16_config`` reads ``fp16``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from zeroshard.config.blocks import BF16Config, FP16Config
from zeroshard.config.checks import fp16_scale_problems
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime._models import MUTABLE, DeepSpeedModel

__all__ = ["DeepSpeedBF16Config", "DeepSpeedFP16Config", "get_bfloat16_config", "get_float16_config"]


class DeepSpeedBF16Config(DeepSpeedModel, BF16Config):
    """The ``bf16`` block (zeroshard's, with DeepSpeed's constructor)."""

    model_config = MUTABLE


class DeepSpeedFP16Config(DeepSpeedModel, FP16Config):
    """The ``fp16`` block (zeroshard's, with DeepSpeed's constructor); like DeepSpeed's, it also refuses a
    non-positive ``loss_scale_window`` or ``min_loss_scale`` under dynamic loss scaling (the rule the
    whole config's check applies, ``fp16_scale_problems``)."""

    model_config = MUTABLE

    @model_validator(mode="after")
    def _dynamic_scale_bounds(self) -> DeepSpeedFP16Config:
        problems = fp16_scale_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def initial_dynamic_scale(self) -> int:
        """The first dynamic loss scale, ``2 ** initial_scale_power``."""
        return int(2**self.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The dynamic loss scaler's settings, under DeepSpeed's keys (its ``fp16.loss_scaler`` constants)."""
        return {
            "init_scale": 2**self.initial_scale_power,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> DeepSpeedBF16Config:
    """The ds_config's ``bf16`` block (or ``bfloat16``), defaults where absent."""
    block = param_dict.get("bf16")
    return DeepSpeedBF16Config(**(param_dict.get("bfloat16", {}) if block is None else block))


def get_float16_config(param_dict: Mapping[str, Any]) -> DeepSpeedFP16Config:
    """The ds_config's ``fp16`` block, defaults where absent."""
    return DeepSpeedFP16Config(**param_dict.get("fp16", {}))


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
