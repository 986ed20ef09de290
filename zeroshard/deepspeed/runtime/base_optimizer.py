"""``deepspeed.runtime.base_optimizer``: the base classes of DeepSpeed's ZeRO optimizers, for ``isinstance``.

zeroshard's ``initialize`` returns the client's own ``torch.optim.Optimizer`` (re-seated on this rank's
shards), never an instance of these: code that asks ``isinstance(opt, (Optimizer, DeepSpeedOptimizer))``, as
Lightning Fabric's ``DeepSpeedStrategy.load_checkpoint`` does, sees a torch optimizer.
"""

from __future__ import annotations

from zeroshard.deepspeed import surface

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]


class DeepSpeedOptimizer:
    """DeepSpeed's optimizer base class; zeroshard has no subclass of it."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """DeepSpeed's ZeRO optimizer base class; zeroshard has no subclass of it."""


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
