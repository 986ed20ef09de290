"""Hybrid sharding (``zero_optimization.mics_shard_size``, DeepSpeed's MiCS): parity with single-process
training at stages 1-3, checkpoints across world and shard sizes, and the bytes each group moves and that
cross nodes (core/hybrid.py [Note: hybrid sharding], core/traffic.py [Note: bytes across nodes]).

Parity uses test_parity's cases and tolerance (``run_case``, 4e-7 of max|reference| per parameter after
every step), with ``mics_shard_size`` added to each case's config.
"""

from __future__ import annotations

import copy
import os
from typing import Any
from unittest import mock

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model
from tests.test_parity import RTOL, _cases, run_case
from zeroshard.checkpoint.verify import verify_checkpoint
from zeroshard.config import ConfigError, ConfigWarning, load_config
from zeroshard.core.hybrid import check_shard_size
from zeroshard.estimate import estimate_memory

pytestmark = pytest.mark.timeout(900)


def initialize_with(key: str, value: int) -> Any:
    """``zeroshard.initialize`` with ``zero_optimization.<key>`` set to ``value`` in the config given."""
    real = zeroshard.initialize

    def initialize(*args: Any, config: dict[str, Any], **kwargs: Any) -> Any:
        config = copy.deepcopy(config)
        config.setdefault("zero_optimization", {})[key] = value
        return real(*args, config=config, **kwargs)

    return initialize


def parity_worker(rank: int, world_size: int, cases: list[tuple[int, dict[str, Any]]]) -> list[float]:
    out = []
    for shard_size, case in cases:
        with mock.patch.object(zeroshard, "initialize", initialize_with("mics_shard_size", shard_size)):
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


# -- checkpoints ---------------------------------------------------------------------------------------
# Saved at W=4 with the first shard size, resumed at W=4 with the second and at W=2 with the third (-1:
# plain ZeRO); every step's global batch is the same four micro-batches at either world size.
RESUMES = [(2, 4, -1), (4, 2, 1)]


def _ckpt_config(stage: int, shard_size: int, world_size: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4 // world_size,
        "gradient_clipping": 0.05,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "mics_shard_size": shard_size},
    }


def _train(engine: Any, rank: int, world_size: int, steps: range) -> dict[str, torch.Tensor]:
    per_rank = 4 // world_size
    for step in steps:
        for micro in range(per_rank):
            x, y = batch(step, 0, rank * per_rank + micro)
            engine.backward(engine(x, y))
            engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _resume(rank: int, world_size: int, path: str, stage: int, shard_size: int) -> dict[str, torch.Tensor]:
    engine, *_ = zeroshard.initialize(model=make_model(1), config=_ckpt_config(stage, shard_size, world_size))
    loaded, _ = engine.load_checkpoint(path)
    assert loaded is not None and engine.global_steps == 2
    return _train(engine, rank, world_size, range(2, 4))


def _close(got: dict[str, torch.Tensor], want: dict[str, Any], what: str) -> None:
    for name, wanted in want.items():
        value = torch.as_tensor(wanted)
        err = float((got[name] - value).abs().max())
        assert err <= RTOL * float(value.abs().max()), f"{what} {name}: {err}"


def save_worker(rank: int, world_size: int, root: str) -> dict[str, dict[str, Any]]:
    finals = {}
    for stage in (1, 3):
        for saved, same_world, _ in RESUMES:
            path = os.path.join(root, f"stage{stage}-S{saved}")
            engine, *_ = zeroshard.initialize(
                model=make_model(0), config=_ckpt_config(stage, saved, world_size)
            )
            _train(engine, rank, world_size, range(2))
            engine.save_checkpoint(path)
            final = _train(engine, rank, world_size, range(2, 4))
            _close(_resume(rank, world_size, path, stage, same_world), final, f"{path} at S={same_world}")
            finals[path] = {name: value.numpy() for name, value in final.items()}  # no shared memory
    return finals


def resume_worker(rank: int, world_size: int, root: str, finals: dict[str, dict[str, Any]]) -> None:
    for stage in (1, 3):
        for saved, _, smaller_world in RESUMES:
            path = os.path.join(root, f"stage{stage}-S{saved}")
            resumed = _resume(rank, world_size, path, stage, smaller_world)
            _close(resumed, finals[path], f"{path} at W={world_size}, S={smaller_world}")


def test_checkpoints_across_world_and_shard_sizes(tmp_path: Any) -> None:
    root = str(tmp_path)
    finals = run_distributed(save_worker, 4, root, timeout=600)[0]
    for stage in (1, 3):
        # Hybrid: only the first shard group writes (two shard files and the extra file); plain: four.
        assert verify_checkpoint(os.path.join(root, f"stage{stage}-S2")).files == 3
        assert verify_checkpoint(os.path.join(root, f"stage{stage}-S4")).files == 5
    run_distributed(resume_worker, 2, root, finals, timeout=600)


def test_estimate_with_shard_groups() -> None:
    # 16 ranks in shard groups of 8 hold what 8 ranks of plain ZeRO hold; offload is not estimated.
    hybrid = estimate_memory(7e9, gpus_per_node=8, nodes=2, mics_shard_size=8)
    plain = estimate_memory(7e9, gpus_per_node=8, nodes=1, offload="none")
    assert [(r.stage, r.per_gpu) for r in hybrid.rows] == [(r.stage, r.per_gpu) for r in plain.rows]
    with pytest.raises(ValueError, match=r"mics_shard_size: 3 .*16 ranks"):
        estimate_memory(7e9, gpus_per_node=8, nodes=2, mics_shard_size=3)


# -- bytes per step, by group and across nodes ------------------------------------------------------------
# Four ranks on two nodes of two (GROUP_RANK in each rank's environment, as torchrun sets it). P: the
# trainable elements as laid out (padded to the shard size), c / r: bytes per element in the compute /
# reduce dtype, S: the shard size. Per rank and step, counted as comm.py counts volume:
#   ZeRO-3:        gather 2Pc (forward, backward), world Pr (reduce-scatter)
#   MiCS stage 3:  gather 2Pc, shard Pr, replica 2Pr/S (all-reduce of the gradient shard)
#   MiCS stage 1-2: shard Pr + Pc (reduce-scatter, all-gather after the step), replica 2Pr/S
#   ZeRO-3 + hpZ:  gather Pc (forward), hpz Pc (backward, from the secondary shards), world Pr
# Sent to the other node (core/traffic.py): ZeRO-3's direct exchanges send 2 of every 3 messages there,
# half the volume, (2Pc + Pr)/2; MiCS with the shard group on one node only the replica ring, Pr/S; hpZ with
# its groups on one node the forward's gather and the reduce-scatter, (Pc + Pr)/2.
# (stage, mics_shard_size, bf16, zero_hpz_partition_size)
BYTE_CASES = [
    (3, -1, False, 1),
    (3, 2, False, 1),
    (3, -1, True, 1),
    (3, 2, True, 1),
    (1, 2, False, 1),
    (2, 2, True, 1),
    (3, -1, False, 2),
    (3, -1, True, 2),
]


def bytes_worker(rank: int, world_size: int) -> list[tuple[dict[str, int], int, int, int, int]]:
    os.environ.update(GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    out = []
    for stage, shard_size, bf16, hpz in BYTE_CASES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 15), torch.nn.ReLU(), torch.nn.Linear(15, 3))
        zero = {"stage": stage, "mics_shard_size": shard_size, "stage3_param_persistence_threshold": 0}
        zero["zero_hpz_partition_size"] = hpz
        zero.update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)  # gather, release, regather
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": zero,
            "bf16": {"enabled": bf16},
        }
        engine, *_ = zeroshard.initialize(model=model, config=config)
        for step in range(3):
            if step == 2:
                engine.comm.stats.reset()  # count the last step alone
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank))
            # An input that needs a gradient: the first layer's backward reads its weight (gathered again).
            x = x.to(torch.bfloat16 if bf16 else torch.float32).requires_grad_(True)
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
        policy = engine.units[0].policy
        padded = sum(u.layout.padded for u in engine.units)
        by_group = engine.communication_bytes_by_group()
        assert sum(by_group.values()) == engine.communication_bytes()
        out.append(
            (by_group, engine.cross_node_bytes(), padded, policy.compute.itemsize, policy.reduce.itemsize)
        )
    return out


def test_bytes_by_group_and_across_nodes() -> None:
    results = run_distributed(bytes_worker, 4)
    for rank_results in results:
        for (stage, shard_size, bf16, hpz), (by_group, cross, p, c, r) in zip(
            BYTE_CASES, rank_results, strict=True
        ):
            assert (c, r) == ((2, 2) if bf16 else (4, 4))
            if hpz > 1:
                want = {"gather": p * c, "hpz": p * c, "world": p * r}
                want_cross = (p * c + p * r) // 2
            elif shard_size == -1:
                want = {"gather": 2 * p * c, "world": p * r}
                want_cross = (2 * p * c + p * r) // 2
            else:
                after_step = {} if stage == 3 else {"shard": p * r + p * c}
                want = {"gather": 2 * p * c, "shard": p * r, **after_step, "replica": 2 * p * r // shard_size}
                if stage < 3:
                    del want["gather"]
                want_cross = p * r // shard_size
            assert (by_group, cross) == (want, want_cross), (stage, shard_size, bf16, hpz)
