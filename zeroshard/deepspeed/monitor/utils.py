"""``deepspeed.monitor.utils``: whether a monitor's package is installed."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.telemetry.monitors import require_package

__all__ = ["check_tb_availability", "check_wandb_availability"]


def check_tb_availability() -> None:
    """``ImportError`` unless TensorBoard is installed."""
    require_package("tensorboard")


def check_wandb_availability() -> None:
    """``ImportError`` unless Weights & Biases is installed."""
    require_package("wandb")


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
