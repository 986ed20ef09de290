"""ZeRO-Infinity's point, counted: with the optimizer and the parameters on NVMe, a rank keeps none of the
optimizer state in memory, and all of it went to the store.

Two ranks train a stack of linear layers at stage 3 in bf16, built with ``zero.Init(dtype=bfloat16)`` so
that no rank ever holds the whole model. Each rank's optimizer state (fp32 master and Adam's two moments:
12 bytes per element of its shard) must be reported as offloaded by ``memory_breakdown()``, written to the
store, and absent from the resident model state (beyond Adam's per-slice step counters). These are byte
counts of the tensors held, the same on every run. The process's resident memory with a model of 300M
parameters is a benchmark figure (bench/offload.py reports each variant's peak RSS), not a unit test's.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed

WIDTH = 64
BLOCKS = 6
BATCH = 2


def memory_worker(rank: int, world_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("ZEROSHARD_TEST_NVME")) as tmp:
        directory = [tmp] if rank == 0 else [None]
        torch.distributed.broadcast_object_list(directory, src=0)
        nvme = {"device": "nvme", "nvme_path": directory[0]}
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": BATCH,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": 2 * WIDTH * WIDTH,  # several sub-groups: the store is read in pieces
                "reduce_bucket_size": 2 * WIDTH * WIDTH,
                "overlap_comm": False,
                "offload_optimizer": nvme,
                "offload_param": nvme,
                "stage3_max_reuse_distance": 0,
                "stage3_prefetch_bucket_size": 2 * WIDTH * WIDTH,
            },
        }
        torch.manual_seed(0)
        with zeroshard.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
            model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)])
        engine, *_ = zeroshard.initialize(model=model, config=config)
        shard = sum(u.layout.shard_size for u in engine.units)
        losses = []
        for step in range(2):
            x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        swapper = engine.offload.optimizer_swapper
        assert swapper is not None and engine.offload.param_store is not None
        mb = engine.memory_breakdown()
        result = {
            "shard": shard,
            "slices": len(engine.sharded_step.slices),
            "offloaded": mb.offloaded,
            "resident_optimizer_state": mb.optimizer_state,
            "predicted_optimizer_state": mb.predicted.optimizer_state,
            "written": swapper.store.stats.bytes_written,
            "losses": losses,
        }
        engine.destroy()
        torch.distributed.barrier()
    return result


@pytest.mark.timeout(120)
def test_nvme_offload_keeps_no_optimizer_state_in_memory() -> None:
    for rank, r in enumerate(run_distributed(memory_worker, 2)):
        state = 12 * r["shard"]
        assert r["predicted_optimizer_state"] == state, (rank, r)
        assert r["offloaded"] == state, (rank, r)
        assert r["written"] >= state, f"rank {rank}: the optimizer state was not written to the store: {r}"
        assert r["resident_optimizer_state"] <= 4 * r["slices"], (rank, r)  # Adam's step counters only
        assert r["losses"][1] != r["losses"][0]  # it trained
