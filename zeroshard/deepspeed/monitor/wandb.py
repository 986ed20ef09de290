"""``deepspeed.monitor.wandb``: ``WandbMonitor`` (see ``deepspeed.monitor.monitor``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.monitor.monitor import Monitor, WandbMonitor
from zeroshard.deepspeed.monitor.utils import check_wandb_availability

__all__ = ["Monitor", "WandbMonitor", "check_wandb_availability"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
