"""DeepSpeed's `elasticity` block: one global batch that stays valid over a range of GPU counts.

[Note: elasticity]
With `elasticity.enabled`, DeepSpeed (up to 0.19.6; 0.19.8 removed the block) picks the train batch size
itself, so that a job restarted at another world size trains with the same global batch. zeroshard computes
the same numbers under the same conditions (tests/test_elasticity.py compares it with DeepSpeed 0.19.6's own
function over a table of inputs):

- Version 0.1. Candidate batches: each micro batch size, and their least common multiple, scaled by the
  largest highly composite number that keeps it within `max_train_batch_size` (a base equal to the cap is
  kept as is, one above it is dropped). For a candidate, a GPU count is valid when it lies in
  `[min_gpus, max_gpus]` and divides `batch / micro` for some micro batch size dividing the batch. The
  candidate with the most valid counts wins; ties go to the larger batch (`prefer_larger_batch`, the
  default) or the smaller one.
- Version 0.2 (the default) works per node: the same search over nodes with the cap divided by the
  data-parallel ranks per node (`num_gpus_per_node / model_parallel_size`), scaled back to ranks. When the
  current world size is not among the valid ones, the batch becomes the largest multiple of
  `micro * world_size` within the cap (over the micro sizes, the largest result, or the smallest without
  `prefer_larger_batch`) and the current world size is the only valid one.
- For a world size, the micro batch is the largest micro batch size dividing `batch / world_size`, and
  gradient accumulation is `batch // (micro * world_size)`.

Errors (the same conditions as DeepSpeed's, with DeepSpeed's class names; all are `ConfigError`s, so also
`ValueError`s): a setting out of range or missing (`ElasticityConfigError`), a micro batch above the cap,
`model_parallel_size > 1` outside version 0.2, a version above 0.2, `num_gpus_per_node` not a multiple of
`model_parallel_size` in version 0.2 (`ElasticityError`), a world size not among the valid ones
(`ElasticityIncompatibleWorldSize`). In `load_config` the batch keys `train_batch_size`,
`train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` beside an enabled block are an error
unless `ignore_non_elastic_batch_info` is true (then they are replaced, with a warning), and the block must
match the one in the `DEEPSPEED_ELASTICITY_CONFIG` environment variable when a scheduler sets it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.elastic_settings import (
    ENV_CONFIG,
    LATEST_VERSION,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
    ElasticityNoValidWorldSize,
    ElasticityVersionError,
    ElasticSettings,
    ensure_same_as_scheduler,
)
from zeroshard.config.errors import show

__all__ = [
    "ENV_CONFIG",
    "ElasticBatch",
    "ElasticSettings",
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "ElasticityNoValidWorldSize",
    "ElasticityVersionError",
    "compute_elastic_config",
    "elastic_batch",
    "elastic_config",
    "elasticity_enabled",
    "ensure_same_as_scheduler",
]

MINIMUM_DEEPSPEED = (0, 3, 8)
"""The oldest DeepSpeed with elasticity; a scheduler targeting an older one is refused."""

# The smallest highly composite numbers (each has more divisors than any smaller number), enough for
# batches up to about 720K. Scaling a base by one gives a batch with many divisors, so many GPU counts.
_HIGHLY_COMPOSITE = (
    1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720, 840, 1260, 1680, 2520, 5040, 7560, 10080,
    15120, 20160, 25200, 27720, 45360, 50400, 55440, 83160, 110880, 166320, 221760, 277200, 332640,
    498960, 554400, 665280, 720720,
)  # fmt: skip


def _divisors_within(n: int, low: int, high: int) -> set[int]:
    found: set[int] = set()
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            found.update(x for x in (d, n // d) if low <= x <= high)
    return found


def _valid_counts(batch: int, micro: tuple[int, ...], low: int, high: int) -> list[int]:
    """GPU counts in `[low, high]` at which `batch` splits into whole micro batches of one of the sizes."""
    counts: set[int] = set()
    for size in micro:
        if batch % size == 0:
            counts |= _divisors_within(batch // size, low, high)
    return sorted(counts)


def _search(
    micro: tuple[int, ...], cap: int, low: int, high: int, prefer_larger: bool
) -> tuple[int, list[int] | None]:
    """Version 0.1's batch and its valid GPU counts; `None` counts when no candidate was taken."""
    low = low or 1
    high = high or cap // min(micro)
    if max(micro) > cap:
        raise ElasticityConfigError(
            f"elasticity.micro_batch_sizes: {list(micro)} is not allowed; every micro batch size must be at "
            f"most max_train_batch_size {cap}"
        )
    candidates: set[int] = set()
    for base in (*micro, math.lcm(*micro)):
        if base < cap:
            candidates.add(base * max(h for h in _HIGHLY_COMPOSITE if h <= cap // base))
        elif base == cap:
            candidates.add(base)
    batch, counts = min(micro), None
    for candidate in sorted(candidates):
        valid = _valid_counts(candidate, micro, low, high)
        known = len(counts) if counts is not None else 0
        closer = candidate > batch if prefer_larger else candidate < batch
        if len(valid) > known or (len(valid) == known and closer):
            batch, counts = candidate, valid
    return batch, counts


def _first_fitting_micro(
    batch: float, world_size: int, micro: tuple[int, ...], prefer_larger: bool
) -> int | None:
    """Version 0.2's micro batch: the largest size dividing `batch // world_size`, or the first in list
    order without `prefer_larger`."""
    fitting = [size for size in micro if batch // world_size % size == 0]
    if not fitting:
        return None
    return max(fitting) if prefer_larger else fitting[0]


def _per_node(s: ElasticSettings, world_size: int) -> tuple[float, list[int], int | None]:
    """Version 0.2: the batch, the valid data-parallel sizes and a micro batch for `world_size` GPUs."""
    if s.num_gpus_per_node % s.model_parallel_size != 0:
        raise ElasticityError(
            f"elasticity.num_gpus_per_node: {s.num_gpus_per_node} is not allowed with version 0.2; it "
            f"must be a multiple of elasticity.model_parallel_size {s.model_parallel_size}"
        )
    ranks_per_node = s.num_gpus_per_node // s.model_parallel_size
    nodes_batch, nodes = _search(
        s.micro_batch_sizes,
        s.max_train_batch_size // ranks_per_node,
        s.min_gpus // s.num_gpus_per_node,
        s.max_gpus // s.num_gpus_per_node,
        s.prefer_larger_batch,
    )
    if nodes is None:
        raise ElasticityNoValidWorldSize(
            f"elasticity: no node count in [min_gpus {s.min_gpus}, max_gpus {s.max_gpus}] / "
            f"num_gpus_per_node {s.num_gpus_per_node} suits any candidate batch; widen the range or change "
            f"micro_batch_sizes"
        )
    batch = nodes_batch * ranks_per_node
    valid = [n * ranks_per_node for n in nodes]
    if world_size // s.model_parallel_size in valid:
        return (
            batch,
            valid,
            _first_fitting_micro(batch, world_size, s.micro_batch_sizes, s.prefer_larger_batch),
        )
    # Not a planned size: the largest multiple of micro * data-parallel size within the cap. The float
    # arithmetic is DeepSpeed's, so a fractional data-parallel size gives the same numbers.
    ranks = world_size / s.num_gpus_per_node * ranks_per_node
    multiples = [
        math.floor(s.max_train_batch_size / float(m * ranks)) * (m * ranks) for m in s.micro_batch_sizes
    ]
    chosen = max(multiples) if s.prefer_larger_batch else min(multiples)
    return (
        chosen,
        [int(ranks)],
        _first_fitting_micro(chosen, world_size, s.micro_batch_sizes, s.prefer_larger_batch),
    )


def _check_target(target: str) -> None:
    """A scheduler's target DeepSpeed version must have elasticity (0.3.8 or later)."""
    found = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(target))
    if found is None:
        raise ElasticityError(f"target_deepspeed_version: {show(target)} is not a version number")
    release = tuple(int(part) for part in found.group(1).split("."))
    padded = release + (0,) * (len(MINIMUM_DEEPSPEED) - len(release))
    if padded < MINIMUM_DEEPSPEED:
        minimum = ".".join(map(str, MINIMUM_DEEPSPEED))
        raise ElasticityError(
            f"target_deepspeed_version: {target} is not allowed; elasticity needs DeepSpeed {minimum} "
            f"or later"
        )


def _world_size_from_env(version: float) -> int:
    given = os.environ.get("WORLD_SIZE")
    if given is None or not given.isnumeric() or int(given) < 1:
        raise ElasticityConfigError(
            f"elasticity.version {version}: the world size is needed to choose the batch; pass "
            f"world_size or set the WORLD_SIZE environment variable (it is {show(given)})"
        )
    return int(given)


def _largest_dividing_micro(batch: int, world_size: int, s: ElasticSettings, valid: list[int] | None) -> int:
    if valid is None:
        raise ElasticityNoValidWorldSize(
            f"elasticity: no GPU count in [min_gpus {s.min_gpus}, max_gpus {s.max_gpus}] suits any candidate "
            f"batch, so world size {world_size} cannot be used; widen the range or change micro_batch_sizes"
        )
    if world_size not in valid:
        raise ElasticityIncompatibleWorldSize(
            f"elasticity: world size {world_size} is not allowed; the elastic batch {batch} is valid at GPU "
            f"counts {valid}"
        )
    for size in sorted(set(s.micro_batch_sizes), reverse=True):
        if batch // world_size % size == 0:
            return size
    raise ElasticityIncompatibleWorldSize(
        f"elasticity: no micro batch size in {list(s.micro_batch_sizes)} divides the per-rank batch "
        f"{batch} // {world_size}"
    )


def elastic_config(
    settings: ElasticSettings, world_size: int = 0, *, micro_batch: bool = False, target: str | None = None
) -> tuple[int, list[int] | None, int | None]:
    """DeepSpeed 0.19.6's elastic batch for an enabled block (see [Note: elasticity]).

    Args:
        settings: The block, read by `ElasticSettings.read`.
        world_size: The data-parallel world size, or 0 when not known yet (version 0.2 then reads the
            WORLD_SIZE environment variable).
        micro_batch: Choose a micro batch size also when `world_size` is 0.
        target: The DeepSpeed version a scheduler plans for (checked to have elasticity), or None.

    Returns:
        The batch, the valid GPU counts and the micro batch size (None when neither `world_size` nor
        `micro_batch` asks for one). The valid counts are None when no candidate qualified and the smaller
        batch is preferred, and a version 0.2 micro batch may be None when no size divides the batch, both
        as in DeepSpeed.

    Raises:
        ElasticityError: Or one of its subclasses, under DeepSpeed's conditions (see [Note: elasticity]).
    """
    s = settings
    if s.model_parallel_size > 1 and s.version != LATEST_VERSION:
        raise ElasticityConfigError(
            f"elasticity.model_parallel_size: {s.model_parallel_size} is not allowed with elasticity.version "
            f"{s.version_given}; model parallelism needs version {LATEST_VERSION}"
        )
    if s.version > LATEST_VERSION:
        raise ElasticityConfigError(
            f"elasticity.version: {show(s.version_given)} is not allowed; the latest version is "
            f"{LATEST_VERSION}"
        )
    if target is not None:
        _check_target(target)
    if world_size < 0:
        raise ElasticityConfigError(f"world_size: {world_size} is not allowed; expected 0 (unknown) or >= 1")
    candidate_micro: int | None = None
    if s.version == 0.1:
        batch_f: float
        batch_f, valid = _search(
            s.micro_batch_sizes, s.max_train_batch_size, s.min_gpus, s.max_gpus, s.prefer_larger_batch
        )
    elif s.version == LATEST_VERSION:
        gpus = world_size or _world_size_from_env(s.version)
        batch_f, valid, candidate_micro = _per_node(s, gpus)
    else:
        raise ElasticityVersionError(
            f"elasticity.version: {show(s.version_given)} is not allowed; expected 0.1 or {LATEST_VERSION}"
        )
    batch = int(batch_f)
    if world_size > 0:
        return batch, valid, _largest_dividing_micro(batch, world_size, s, valid)
    if not micro_batch:
        return batch, valid, None
    if s.version == LATEST_VERSION:
        return batch, valid, candidate_micro
    gpus = _world_size_from_env(s.version)
    return batch, valid, _largest_dividing_micro(batch, gpus, s, valid)


def elasticity_enabled(ds_config: Mapping[str, Any]) -> bool:
    """Whether `ds_config` has an `elasticity` block with `enabled` true."""
    block = ds_config.get("elasticity")
    return isinstance(block, Mapping) and bool(block.get("enabled", False))


def compute_elastic_config(
    ds_config: Any, target_deepspeed_version: str, world_size: int = 0, return_microbatch: bool = False
) -> tuple[int, list[int] | None] | tuple[int, list[int] | None, int | None]:
    """DeepSpeed 0.19.6's ``deepspeed.elasticity.compute_elastic_config``: the elastic batch of a whole
    ds_config (a dict), with the same results and the same error conditions.

    Args:
        ds_config: The config, with an enabled `elasticity` block.
        target_deepspeed_version: The DeepSpeed version the job will run (0.3.8 or later).
        world_size: The data-parallel world size, 0 when not known (see `elastic_config`).
        return_microbatch: Return a micro batch size also when `world_size` is 0.

    Returns:
        `(batch, valid GPU counts)`, with the micro batch size third when `world_size > 0` or
        `return_microbatch`.

    Raises:
        ElasticityConfigError: `ds_config` is not a dict (also a `ValueError`, DeepSpeed's type), has no
            `elasticity` block, or the block is disabled or invalid.
        ElasticityError: Or another subclass, see `elastic_config`.
    """
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError(f"ds_config: {show(ds_config)} is not allowed; expected a dict")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity: missing; an elastic job needs an `elasticity` block")
    block = ds_config["elasticity"]
    if not (isinstance(block, Mapping) and block.get("enabled", False)):
        given = block.get("enabled", False) if isinstance(block, Mapping) else block
        raise ElasticityConfigError(
            f"elasticity.enabled: {show(given)} is not allowed; an elastic job needs `enabled: true`"
        )
    settings = ElasticSettings.read(block)
    batch, valid, micro = elastic_config(
        settings, world_size, micro_batch=return_microbatch, target=target_deepspeed_version
    )
    if world_size > 0 or return_microbatch:
        return batch, valid, micro
    return batch, valid


@dataclass(frozen=True)
class ElasticBatch:
    """The batch sizes an enabled block gives at one world size.

    Invariant: `train_batch_size == micro_batch_size * gradient_accumulation_steps * world_size` whenever
    `train_batch_size` is a multiple of `micro_batch_size * world_size` (always, except when the cap is
    below one micro batch per rank: then accumulation is 0 and `load_config` refuses it).
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    valid_world_sizes: tuple[int, ...]


def elastic_batch(block: Any, world_size: int) -> ElasticBatch:
    """What DeepSpeed 0.19.6's config sets from an enabled `elasticity` block at `world_size`.

    Checks the block against `DEEPSPEED_ELASTICITY_CONFIG` too (`ensure_same_as_scheduler`).

    Raises:
        ElasticityError: Or one of its subclasses (see [Note: elasticity]).
    """
    settings = ElasticSettings.read(block)
    batch, valid, micro = elastic_config(settings, world_size)
    ensure_same_as_scheduler(block)
    if micro is None:  # unreachable: world_size > 0 always gives a micro batch
        raise RuntimeError(f"elasticity: no micro batch chosen at world size {world_size}")
    return ElasticBatch(
        train_batch_size=batch,
        micro_batch_size=micro,
        gradient_accumulation_steps=batch // (micro * world_size),
        valid_world_sizes=tuple(valid or ()),
    )
