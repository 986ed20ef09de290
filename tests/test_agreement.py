"""``initialize`` checks that every rank built the same model and resolved the same config: a rank with
another layer, another parameter shape, another learning rate or another ZeRO stage makes every rank raise
a ValueError naming the first difference and the ranks on each side, at once instead of at the collective
timeout (or never, for a learning rate). Per-node paths may differ."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(300)


def _model(rank: int, case: str) -> nn.Module:
    torch.manual_seed(0)
    width = 6 if case == "shape" and rank == 1 else 4
    layers = [nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1)]
    if case == "layers" and rank == 1:
        layers.insert(2, nn.Linear(width, width))
    return nn.Sequential(*layers)


def _config(rank: int, case: str) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2 if case == "lr" and rank == 1 else 0.1}},
        "zero_optimization": {
            "stage": 3 if case == "stage" and rank == 1 else 2,
            "offload_optimizer": {"device": "none", "nvme_path": f"/local/node{rank}"},
        },
        "tensorboard": {"enabled": False, "output_path": f"/logs/node{rank}"},
    }


EXPECTED = {
    "layers": "parameter 2.weight",
    "shape": "parameter 0.weight: shape (4, 4)",
    "lr": "config optimizer.params.lr = 0.1",
    "stage": "config zero_optimization.stage = 2",
}


def worker(rank: int, world_size: int) -> list[str]:
    done = []
    for case in ("same", *EXPECTED):
        model = _model(rank, case)
        start = time.monotonic()
        try:
            engine, *_ = zeroshard.initialize(
                model=model, model_parameters=model.parameters(), config=_config(rank, case)
            )
        except ValueError as err:
            message = str(err)
            if case == "same" or EXPECTED[case] not in message or "ranks [0]" not in message:
                raise AssertionError(f"rank {rank}: {case}: {message}") from err
            if "ranks [1]" not in message or time.monotonic() - start > 20:
                raise AssertionError(f"rank {rank}: {case}: {message}") from err
            done.append(case)
            continue
        if case != "same":
            raise AssertionError(f"rank {rank}: {case}: initialize() accepted ranks that differ")
        engine.destroy()
        done.append(case)
    return done


def test_ranks_that_built_different_models_or_configs_are_named() -> None:
    assert run_distributed(worker, 2) == [["same", *EXPECTED]] * 2
