"""Reading DeepSpeed ds_config files: load, resolve "auto", validate, explain mistakes.

`load_config` turns a ds_config (dict or JSON file) into a frozen `ZeroshardConfig`; see docs/config.md for
the rules and every default.
"""

from __future__ import annotations

from zeroshard.config.blocks import (
    BF16Config,
    FP16Config,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OptimizerSpec,
    SchedulerSpec,
    ZeroConfig,
)
from zeroshard.config.errors import ConfigError, ConfigTypeError, ConfigWarning
from zeroshard.config.load import add_config_arguments, load_config, resolve_config_source
from zeroshard.config.schema import ZeroshardConfig

__all__ = [
    "BF16Config",
    "ConfigError",
    "ConfigTypeError",
    "ConfigWarning",
    "FP16Config",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerSpec",
    "SchedulerSpec",
    "ZeroConfig",
    "ZeroshardConfig",
    "add_config_arguments",
    "load_config",
    "resolve_config_source",
]
