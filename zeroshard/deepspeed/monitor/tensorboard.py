"""``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor`` (see ``deepspeed.monitor.monitor``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.monitor.monitor import Monitor, TensorBoardMonitor
from zeroshard.deepspeed.monitor.utils import check_tb_availability

__all__ = ["Monitor", "TensorBoardMonitor", "check_tb_availability"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
