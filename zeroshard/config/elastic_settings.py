"""The `elasticity` block read and checked as DeepSpeed 0.19.6 reads it, DeepSpeed's elasticity error classes,
and the check against the block an elastic scheduler planned with. What the block computes is in
`elasticity.py` ([Note: elasticity]).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.errors import ConfigError, ConfigTypeError, show

__all__ = [
    "ENV_CONFIG",
    "LATEST_VERSION",
    "ElasticSettings",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "ElasticityNoValidWorldSize",
    "ElasticityVersionError",
    "ensure_same_as_scheduler",
]

logger = logging.getLogger(__name__)

ENV_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"
"""Environment variable in which an elastic scheduler passes the block it planned the job with (JSON)."""

LATEST_VERSION = 0.2
"""The newest elasticity version, and the default."""


class ElasticityError(ConfigError):
    """An elasticity problem (DeepSpeed's ``deepspeed.elasticity.config.ElasticityError``); a
    `ConfigError`."""


class ElasticityConfigError(ElasticityError):
    """A missing or out-of-range setting of the `elasticity` block (DeepSpeed's class of that name)."""


class ElasticityIncompatibleWorldSize(ElasticityError):
    """The world size is not one the block's batch is valid for (DeepSpeed's class of that name)."""


class ElasticityNoValidWorldSize(ElasticityIncompatibleWorldSize, ConfigTypeError):
    """No GPU count in `[min_gpus, max_gpus]` suits any candidate batch. DeepSpeed fails here on its empty
    result with a ``TypeError``, so this one is also a `TypeError`."""


class ElasticityVersionError(ElasticityConfigError, NotImplementedError):
    """A version below the latest that is neither 0.1 nor 0.2 (DeepSpeed raises ``NotImplementedError``)."""


def _count(block: Mapping[str, Any], key: str, default: int, least: int) -> int:
    value = block.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON writes big numbers as floats (1e4); see [Note: numbers]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ElasticityConfigError(
            f"elasticity.{key}: {show(value)} is not allowed; expected an integer >= {least}"
        )
    return value


def _flag(block: Mapping[str, Any], key: str, default: bool) -> bool:
    value = block.get(key, default)
    if not isinstance(value, bool):
        raise ElasticityConfigError(f"elasticity.{key}: {show(value)} is not allowed; expected true or false")
    return value


def _version(value: Any) -> float:
    try:
        number = (
            float(value) if isinstance(value, int | float | str) and not isinstance(value, bool) else None
        )
    except ValueError:
        number = None
    if number is None or not math.isfinite(number):
        raise ElasticityConfigError(
            f"elasticity.version: {show(value)} is not allowed; expected 0.1 or {LATEST_VERSION}"
        )
    return number


def _micro_sizes(block: Mapping[str, Any], enabled: bool) -> tuple[int, ...]:
    if enabled and "micro_batch_sizes" not in block:
        raise ElasticityConfigError(
            "elasticity.micro_batch_sizes: missing; an enabled block needs the list of acceptable "
            "micro batch sizes"
        )
    value = block.get("micro_batch_sizes", [2, 4, 6])
    if not isinstance(value, list) or not value:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: {show(value)} is not allowed; expected a list of integers >= 1"
        )
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in value):
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: {show(value)} is not allowed; every entry must be an integer >= 1"
        )
    return tuple(value)


@dataclass(frozen=True)
class ElasticSettings:
    """The `elasticity` block read with DeepSpeed 0.19.6's defaults and checks.

    Invariants: every count is at least 1 (`min_time` at least 0), `min_gpus <= max_gpus`, and
    `micro_batch_sizes` is a non-empty list of positive integers in the order given.
    """

    enabled: bool
    max_train_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    min_gpus: int
    max_gpus: int
    num_gpus_per_node: int
    model_parallel_size: int
    min_time: float
    prefer_larger_batch: bool
    ignore_non_elastic_batch_info: bool
    version: float
    version_given: Any
    """`version` as written (the scheduler check compares what was written, as DeepSpeed does)."""

    @classmethod
    def read(cls, block: Any) -> ElasticSettings:
        """Reads a block; raises `ElasticityConfigError` naming the key and value of the first problem."""
        if not isinstance(block, Mapping):
            raise ElasticityConfigError(
                f"elasticity: {show(block)} is not allowed; expected an object ({{...}})"
            )
        enabled = _flag(block, "enabled", False)
        if enabled and "max_train_batch_size" not in block:
            raise ElasticityConfigError(
                "elasticity.max_train_batch_size: missing; an enabled block needs the largest acceptable "
                "train batch size"
            )
        cap = _count(block, "max_train_batch_size", 2000, 1)
        micro = _micro_sizes(block, enabled)
        low, high = _count(block, "min_gpus", 1, 1), _count(block, "max_gpus", 10000, 1)
        if high < low:
            raise ElasticityConfigError(
                f"elasticity.min_gpus: {low} is above elasticity.max_gpus {high}; expected "
                f"min_gpus <= max_gpus"
            )
        min_time = block.get("min_time", 0)
        if isinstance(min_time, bool) or not isinstance(min_time, int | float) or not min_time >= 0:
            raise ElasticityConfigError(
                f"elasticity.min_time: {show(min_time)} is not allowed; expected >= 0"
            )
        given = block.get("version", LATEST_VERSION)
        return cls(
            enabled=enabled,
            max_train_batch_size=cap,
            micro_batch_sizes=micro,
            min_gpus=low,
            max_gpus=high,
            model_parallel_size=_count(block, "model_parallel_size", 1, 1),
            num_gpus_per_node=_count(block, "num_gpus_per_node", 1, 1),
            min_time=min_time,
            prefer_larger_batch=_flag(block, "prefer_larger_batch", True),
            ignore_non_elastic_batch_info=_flag(block, "ignore_non_elastic_batch_info", False),
            version=_version(given),
            version_given=given,
        )


def ensure_same_as_scheduler(block: Any) -> None:
    """Checks `block` against the one an elastic scheduler planned with, in `DEEPSPEED_ELASTICITY_CONFIG`.

    Without the variable it only logs that nothing can check that the job is scaled to valid GPU counts.

    Raises:
        ElasticityConfigError: When `max_train_batch_size`, `micro_batch_sizes` or `version` differ (or
            either block is invalid), naming the key and both values.
    """
    planned_text = os.environ.get(ENV_CONFIG)
    if planned_text is None:
        logger.warning(
            "%s is not set, so nothing checks that a scheduler scales this elastic job to valid GPU counts",
            ENV_CONFIG,
        )
        return
    try:
        planned = ElasticSettings.read(json.loads(planned_text))
    except ValueError as err:  # bad JSON, or an invalid block (an ElasticityError is a ValueError)
        raise ElasticityConfigError(
            f"{ENV_CONFIG}: {show(planned_text)} is not a valid elasticity block ({err})"
        ) from None
    ours = ElasticSettings.read(block)
    pairs = (
        ("max_train_batch_size", planned.max_train_batch_size, ours.max_train_batch_size),
        ("micro_batch_sizes", list(planned.micro_batch_sizes), list(ours.micro_batch_sizes)),
        ("version", planned.version_given, ours.version_given),
    )
    for key, theirs, mine in pairs:
        if theirs != mine:
            raise ElasticityConfigError(
                f"elasticity.{key}: {show(mine)} differs from {show(theirs)} in {ENV_CONFIG}, the block the "
                f"scheduler planned this job with; use the same block for both"
            )
