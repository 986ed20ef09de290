"""``deepspeed.monitor.config``: the monitor blocks (zeroshard's, with DeepSpeed's constructor) and
``DeepSpeedMonitorConfig``, the four of them together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from zeroshard.config import run_blocks
from zeroshard.config.values import Block
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime._models import MUTABLE, DeepSpeedModel

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]

MONITOR_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet")


class TensorBoardConfig(DeepSpeedModel, run_blocks.TensorBoardConfig):
    """The ``tensorboard`` block."""

    model_config = MUTABLE


class WandbConfig(DeepSpeedModel, run_blocks.WandbConfig):
    """The ``wandb`` block."""

    model_config = MUTABLE


class CSVConfig(DeepSpeedModel, run_blocks.CSVConfig):
    """The ``csv_monitor`` block."""

    model_config = MUTABLE


class CometConfig(DeepSpeedModel, run_blocks.CometConfig):
    """The ``comet`` block (zeroshard writes no Comet events; the config warns when it is enabled)."""

    model_config = MUTABLE


class DeepSpeedMonitorConfig(DeepSpeedModel, Block):
    """The four monitor blocks of a ds_config; ``enabled`` when any of them is."""

    model_config = MUTABLE

    # DeepSpeed's defaults, {} validated into the block.
    tensorboard: TensorBoardConfig = Field(default={}, validate_default=True)
    comet: CometConfig = Field(default={}, validate_default=True)
    wandb: WandbConfig = Field(default={}, validate_default=True)
    csv_monitor: CSVConfig = Field(default={}, validate_default=True)

    @property
    def enabled(self) -> bool:
        """Whether any monitor is enabled."""
        return any(getattr(self, key).enabled for key in MONITOR_KEYS)

    def check_enabled(self) -> DeepSpeedMonitorConfig:
        """DeepSpeed's validator (``enabled`` is computed here, so there is nothing to do)."""
        return self


def get_monitor_config(param_dict: Mapping[str, Any]) -> DeepSpeedMonitorConfig:
    """The monitor blocks of a ds_config dict."""
    return DeepSpeedMonitorConfig(**{key: param_dict.get(key, {}) for key in MONITOR_KEYS})


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
