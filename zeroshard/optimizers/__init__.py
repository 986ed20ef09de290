"""Small optimizers that DeepSpeed configs name and torch.optim lacks."""

from __future__ import annotations

from zeroshard.optimizers.adam import DeepSpeedAdam
from zeroshard.optimizers.fused_adam import DeepSpeedCPUAdam, FusedAdam
from zeroshard.optimizers.lamb import Lamb
from zeroshard.optimizers.lion import Lion

__all__ = ["DeepSpeedAdam", "DeepSpeedCPUAdam", "FusedAdam", "Lamb", "Lion"]
