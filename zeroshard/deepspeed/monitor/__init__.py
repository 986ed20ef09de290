"""``deepspeed.monitor``: DeepSpeed's monitor classes over zeroshard's TensorBoard, CSV and W&B writers
(``zeroshard.telemetry.monitors``); the Comet monitor is refused at use."""

from __future__ import annotations

from zeroshard.deepspeed import surface

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
