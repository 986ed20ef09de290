"""``deepspeed.runtime.config``: ``DeepSpeedConfig`` builds zeroshard's validated config."""

from __future__ import annotations

from typing import Any

from zeroshard.config import ZeroshardConfig, load_config
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.comm import get_world_size
from zeroshard.errors import DeepSpeedConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


def DeepSpeedConfig(
    config: str | dict[str, Any], mpu: Any = None, mesh_device: Any = None
) -> ZeroshardConfig:
    """Load and validate a ds_config (a dict or a JSON path) for this world size, as DeepSpeed's class does.

    Returns zeroshard's :class:`~zeroshard.config.ZeroshardConfig`: the same keys as attributes
    (``cfg.zero_optimization.stage``), and as items (``cfg["zero_optimization"]["stage"]``).
    """
    if mpu is not None:
        raise ValueError("DeepSpeedConfig(mpu=...): model parallelism is not supported by zeroshard")
    return load_config(config, world_size=get_world_size())


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
