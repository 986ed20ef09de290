"""hpZ (``zero_optimization.zero_hpz_partition_size``, ZeRO++'s hierarchical partitioning) at stage 3: the
backward gathers from node-local secondary shards (core/stage3/secondary.py [Note: hpZ secondary shards]).

At W=4 with groups of S=2: parity with single-process training (test_parity's cases and tolerance), runs
bit-identical to plain ZeRO-3 (the same values move, over a smaller group) with activation checkpointing,
gradient accumulation, bf16 and parameters changed by hand between micro-steps, the secondary shards'
memory, and a checkpoint round trip. The bytes by group and across nodes are in test_hybrid.py.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model
from tests.test_hybrid import initialize_with
from tests.test_parity import RTOL, _cases, run_case
from zeroshard.config import ConfigError, ConfigWarning, load_config
from zeroshard.core.hybrid import check_hpz_size
from zeroshard.estimate import estimate_memory
from zeroshard.zero import GatheredParameters

pytestmark = pytest.mark.timeout(900)

WORLD, HPZ = 4, 2


def parity_worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[float]:
    with mock.patch.object(zeroshard, "initialize", initialize_with("zero_hpz_partition_size", HPZ)):
        return [run_case(rank, world_size, **case) for case in cases]


def test_hpz_parity() -> None:
    cases = _cases([3])
    worst = max(max(r) for r in run_distributed(parity_worker, WORLD, cases, timeout=840))
    assert worst <= RTOL, worst


# -- bit-identical to plain ZeRO-3 ------------------------------------------------------------------------
class Blocks(nn.Module):
    """Two residual blocks of ``width`` -> ``hidden`` -> ``width`` and a head; ``reentrant`` None: no
    activation checkpointing."""

    def __init__(self, reentrant: bool | None, width: int = 8, hidden: int = 13) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, width)) for _ in "ab"
        )
        self.head = nn.Linear(width, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.reentrant is None:
                x = x + block(x)
            else:  # recomputed in backward: its gathers happen in the backward phase
                x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x).float().pow(2).mean()


def _train(
    rank: int, hpz: int, case: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, int], int, int]:
    """Train ``case`` with groups of ``hpz``; the final parameters, bytes by group, the secondary shards'
    bytes after the last backward (before its step), and the units' padded elements."""
    torch.manual_seed(0)
    model = Blocks(case["reentrant"])
    zero = {"stage": 3, "zero_hpz_partition_size": hpz, "stage3_param_persistence_threshold": 0}
    # Each unit released after its forward and gathered again for its backward; with or without prefetch.
    zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=case["prefetch"])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": case["gas"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {**zero, "reduce_bucket_size": 40, "allgather_bucket_size": 40},
        "bf16": {"enabled": case["bf16"]},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    assert len(engine.units) > 1
    held = 0
    for step in range(3):
        for micro in range(case["gas"]):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randn(4, 8, generator=g).to(torch.bfloat16 if case["bf16"] else torch.float32)
            engine.backward(engine(x.requires_grad_(True)))
            if case["modify"] and micro == 0:  # changed by hand: the secondary shards are stale
                with GatheredParameters(list(model.parameters()), modifier_rank=0):
                    with torch.no_grad():
                        model.blocks[0][0].weight.mul_(0.5)  # regathered in backward
            held = sum(
                u.secondary.numel() * u.secondary.element_size()
                for u in engine.units
                if u.secondary is not None
            )
            engine.step()
        assert all(u.secondary is None for u in engine.units), "a secondary shard outlived the step"
    with engine.gathered_parameters():
        final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    padded = sum(u.layout.padded for u in engine.units)
    return final, engine.communication_bytes_by_group(), held, padded


IDENTICAL_CASES = [
    {"reentrant": r, "gas": g, "bf16": b, "modify": m, "prefetch": p}
    for r, g, b, m, p in [
        (None, 1, False, False, 0),
        (False, 1, False, False, 100),
        (True, 2, False, False, 0),
        (None, 2, True, False, 100),
        (False, 2, True, False, 0),
        (None, 2, False, True, 0),
        (False, 2, False, True, 100),
    ]
]


def identical_worker(rank: int, world_size: int) -> list[str]:
    problems = []
    for case in IDENTICAL_CASES:
        plain, plain_bytes, plain_held, _ = _train(rank, 1, case)
        hpz, hpz_bytes, held, padded = _train(rank, HPZ, case)
        for name, value in plain.items():
            if not torch.equal(value, hpz[name]):
                problems.append(f"{case} {name}: {float((value - hpz[name]).abs().max())}")
        if plain_held or "hpz" in plain_bytes or not hpz_bytes.get("hpz"):
            problems.append(f"{case}: plain {plain_bytes}, {plain_held} held; hpZ {hpz_bytes}")
        # The backward's gathers moved from the world group to the hpZ group, byte for byte.
        if hpz_bytes["gather"] + hpz_bytes["hpz"] != plain_bytes["gather"]:
            problems.append(f"{case}: gathers plain {plain_bytes}, hpZ {hpz_bytes}")
        itemsize = 2 if case["bf16"] else 4
        if held != padded // HPZ * itemsize:
            problems.append(
                f"{case}: secondary shards hold {held} bytes, expected {padded // HPZ * itemsize}"
            )
    return problems


def test_hpz_matches_plain_zero3_bit_for_bit() -> None:
    results = run_distributed(identical_worker, WORLD, timeout=840)
    assert results == [[]] * WORLD, results


# -- checkpoints --------------------------------------------------------------------------------------------
def _ckpt_engine(hpz: int) -> Any:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz},
    }
    return zeroshard.initialize(model=make_model(0), config=config)[0]


def _steps(engine: Any, rank: int, steps: range) -> dict[str, torch.Tensor]:
    for step in steps:
        for micro in range(2):
            x, y = batch(step, micro, rank)
            engine.backward(engine(x, y))
            engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def checkpoint_worker(rank: int, world_size: int, root: str) -> list[str]:
    path = os.path.join(root, "hpz")
    engine = _ckpt_engine(HPZ)
    _steps(engine, rank, range(2))
    engine.save_checkpoint(path)
    final = _steps(engine, rank, range(2, 4))
    problems = []
    for hpz in (HPZ, 1):  # resumed with hpZ and without: the same run
        resumed = _ckpt_engine(hpz)
        loaded, _ = resumed.load_checkpoint(path)
        assert loaded is not None and resumed.global_steps == 2
        got = _steps(resumed, rank, range(2, 4))
        problems += [f"resumed with hpZ {hpz}: {n}" for n, v in final.items() if not torch.equal(got[n], v)]
    return problems


def test_hpz_checkpoint_round_trip(tmp_path: Any) -> None:
    results = run_distributed(checkpoint_worker, WORLD, str(tmp_path), timeout=600)
    assert results == [[]] * WORLD, results


# -- config ------------------------------------------------------------------------------------------------
def test_hpz_config() -> None:
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}

    def load(**zero: Any) -> Any:
        return load_config({**base, "zero_optimization": zero}, world_size=4)

    assert load(stage=3, zero_hpz_partition_size=2).zero_optimization.zero_hpz_partition_size == 2
    with pytest.warns(ConfigWarning, match="zero_hpz_partition_size: 2 has no effect at stage 2"):
        load(stage=2, zero_hpz_partition_size=2)
    with pytest.raises(
        ConfigError, match=r"zero_hpz_partition_size: 2 with zero_optimization.mics_shard_size: 2"
    ):
        load(stage=3, zero_hpz_partition_size=2, mics_shard_size=2)
    with pytest.raises(ConfigError, match=r"zero_hpz_partition_size: 2 with .*offload_param.device 'cpu'"):
        load(stage=3, zero_hpz_partition_size=2, offload_param={"device": "cpu"})
    for size, world in ((3, 4), (3, 8)):
        with pytest.raises(ValueError, match=rf"zero_hpz_partition_size: {size} .*{world} ranks"):
            check_hpz_size(size, world)
    for size, world in ((0, 4), (1, 4), (2, 4), (4, 4), (8, 4), (3, 1)):
        check_hpz_size(size, world)


def test_estimate_with_hpz() -> None:
    # Two nodes of 8: stage 3 keeps a secondary shard of 1/8 of the bf16 parameters beside ZeRO-3's state.
    hpz = estimate_memory(7e9, gpus_per_node=8, nodes=2, hpz_partition_size=8)
    plain = estimate_memory(7e9, gpus_per_node=8, nodes=2, offload="none")
    assert [r.offload for r in hpz.rows] == ["none"] * 4
    for got, want in zip(hpz.rows, plain.rows, strict=True):
        assert got.per_gpu == want.per_gpu + (2 * 7_000_000_000 // 8 if got.stage == 3 else 0)
    with pytest.raises(ValueError, match=r"hpz_partition_size: 8 with mics_shard_size: 8"):
        estimate_memory(7e9, gpus_per_node=8, nodes=2, hpz_partition_size=8, mics_shard_size=8)
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size: 3 .*16 ranks"):
        estimate_memory(7e9, gpus_per_node=8, nodes=2, hpz_partition_size=3)
