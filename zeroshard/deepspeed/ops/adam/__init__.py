"""``deepspeed.ops.adam``: ``DeepSpeedCPUAdam`` and ``FusedAdam`` with DeepSpeed's signatures.

Both are zeroshard's (``zeroshard/optimizers/fused_adam.py``, [Note: DeepSpeed's Adam classes]): torch's fused
Adam kernel, on whichever device the parameters are, with DeepSpeed's defaults and ``bias_correction``. The
engine builds them for a config's ``"Adam"``/``"AdamW"`` as DeepSpeed does.
"""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.optimizers.fused_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
