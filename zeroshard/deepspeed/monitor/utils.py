"""``deepspeed.monitor.utils``: whether a monitor's package is installed."""

from __future__ import annotations

import importlib.util

from zeroshard.deepspeed import surface

__all__ = ["check_tb_availability", "check_wandb_availability"]


def _require(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"the {module} package is not installed: pip install 'zeroshard[{extra}]'")


def check_tb_availability() -> None:
    """``ImportError`` unless TensorBoard is installed."""
    _require("tensorboard", "tensorboard")


def check_wandb_availability() -> None:
    """``ImportError`` unless Weights & Biases is installed."""
    _require("wandb", "wandb")


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
