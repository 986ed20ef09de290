"""Hybrid sharding (``zero_optimization.mics_shard_size``, DeepSpeed's MiCS): parity with single-process
training at stages 1-3, checkpoints across world and shard sizes, and the bytes each group moves and that
cross nodes (core/hybrid.py [Note: hybrid sharding], core/traffic.py [Note: bytes across nodes]).

Parity uses test_parity's cases and tolerance (``run_case``, 4e-7 of max|reference| per parameter after
every step), with ``mics_shard_size`` added to each case's config.
"""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest

import zeroshard
from tests.distributed import run_distributed
from tests.test_parity import RTOL, _cases, run_case
from zeroshard.config import ConfigError, ConfigWarning, load_config
from zeroshard.core.hybrid import check_shard_size

pytestmark = pytest.mark.timeout(900)


def _initialize_with(shard_size: int) -> Any:
    """``zeroshard.initialize`` with ``zero_optimization.mics_shard_size`` set in the config it is given."""
    real = zeroshard.initialize

    def initialize(*args: Any, config: dict[str, Any], **kwargs: Any) -> Any:
        config = copy.deepcopy(config)
        config.setdefault("zero_optimization", {})["mics_shard_size"] = shard_size
        return real(*args, config=config, **kwargs)

    return initialize


def parity_worker(rank: int, world_size: int, cases: list[tuple[int, dict[str, Any]]]) -> list[float]:
    out = []
    for shard_size, case in cases:
        with mock.patch.object(zeroshard, "initialize", _initialize_with(shard_size)):
            out.append(run_case(rank, world_size, **case))
    return out


def _parity_cases(world_size: int) -> list[tuple[int, dict[str, Any]]]:
    half = world_size // 2
    cases = [(half, case) for case in _cases([1, 2, 3])[::2]]  # 4 cases per stage
    cases += [(1, case) for case in _cases([1, 2, 3])[1::4]]  # every rank a shard group of its own
    cases += [(world_size, case) for case in _cases([2, 3])[3::4]]  # the whole world: plain ZeRO
    return cases


@pytest.mark.parametrize("world_size", [2, 4])
def test_hybrid_parity(world_size: int) -> None:
    cases = _parity_cases(world_size)
    results = run_distributed(parity_worker, world_size, cases, timeout=840)
    worst = max(max(r) for r in results)
    assert worst <= RTOL, worst
    print(f"world_size {world_size}: worst relative parameter error over {len(cases)} cases: {worst:.2e}")


def test_shard_size_must_divide_the_world() -> None:
    for size, world in ((3, 4), (8, 4), (-2, 4)):
        with pytest.raises(ValueError, match=rf"mics_shard_size: {size} .*{world} ranks"):
            check_shard_size(size, world)
    for size, world in ((-1, 4), (0, 4), (1, 4), (2, 4), (4, 4), (1, 1)):
        check_shard_size(size, world)


def test_config_keys() -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    zero = {"stage": 3, "mics_shard_size": 2, "mics_hierarchical_params_gather": True}
    with pytest.warns(ConfigWarning, match="mics_hierarchical_params_gather: true has no effect") as caught:
        cfg = load_config({**base, "zero_optimization": zero}, world_size=4)
    assert cfg.zero_optimization.mics_shard_size == 2
    assert not any("MiCS" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with pytest.warns(ConfigWarning, match="mics_shard_size has no effect at stage 0"):
        load_config({**base, "zero_optimization": {"stage": 0, "mics_shard_size": 2}}, world_size=4)
    offload = {"stage": 2, "mics_shard_size": 2, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=r"mics_shard_size: 2 with zero_optimization.offload_optimizer"):
        load_config({**base, "zero_optimization": offload}, world_size=4)
    with pytest.raises(ConfigError, match=r"mics_shard_size: -3 is not allowed"):
        load_config({**base, "zero_optimization": {"stage": 1, "mics_shard_size": -3}}, world_size=4)
