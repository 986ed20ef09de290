"""``deepspeed.elasticity`` as DeepSpeed 0.19.6 had it (0.19.8, the inventory's DeepSpeed, removed it).

The names a script imports from it, forwarding to zeroshard's implementation in
``zeroshard/config/elasticity.py`` ([Note: elasticity] there): ``compute_elastic_config`` with 0.19.6's
signature and results, ``elasticity_enabled``, ``ensure_immutable_elastic_config``, the block's key
constants, and the three error classes (also ``ValueError`` s, as every zeroshard config error is).
``initialize()`` applies an enabled block itself; a script needs these only to plan a job, as a scheduler
does. ``DSElasticAgent`` (torch-elastic's agent, for DeepSpeed's own launcher) is not provided.
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.elasticity import (
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    compute_elastic_config,
    elasticity_enabled,
    ensure_same_as_scheduler,
)
from zeroshard.deepspeed import surface

__all__ = [
    "ELASTICITY",
    "ENABLED",
    "ENABLED_DEFAULT",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
    "ensure_immutable_elastic_config",
    "is_torch_elastic_compatible",
]

ELASTICITY = "elasticity"
ENABLED = "enabled"
ENABLED_DEFAULT = False


def ensure_immutable_elastic_config(runtime_elastic_config_dict: dict[str, Any]) -> None:
    """Checks the `elasticity` block against the one in ``DEEPSPEED_ELASTICITY_CONFIG`` (set by an elastic
    scheduler); raises `ElasticityConfigError` naming the first differing key, and only logs a warning when
    the variable is not set."""
    ensure_same_as_scheduler(runtime_elastic_config_dict)


def is_torch_elastic_compatible() -> bool:
    """Whether torch has torch-elastic (1.11 or later): always, for the torch zeroshard needs."""
    return True


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
