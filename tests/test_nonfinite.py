"""A non-finite loss without loss scaling (fp32): the step is skipped on every rank, as DeepSpeed's ZeRO
optimizer skips it, and training goes on equal to a run that never saw that batch; with
ZEROSHARD_STOP_ON_NONFINITE=1 every rank raises FloatingPointError naming the step and the parameters."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(300)

BAD_STEP = 1


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    x, y = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
    if step == BAD_STEP and rank == 1:
        x[0, 0] = float("nan")  # one rank's batch is bad: every rank must skip
    return x, y


def worker(rank: int, world_size: int) -> list[str]:
    ref = _net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        if step == BAD_STEP:
            continue
        opt.zero_grad()
        for r in range(world_size):
            x, y = _data(step, r)
            (F.mse_loss(ref(x), y) / world_size).backward()
        opt.step()
    done = []
    for stage in (0, 2, 3):
        for stop in (False, True):
            os.environ["ZEROSHARD_STOP_ON_NONFINITE"] = "1" if stop else "0"
            model = _net()
            config = {
                "train_micro_batch_size_per_gpu": 3,
                "gradient_clipping": 1e9,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            }
            engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
            case = f"stage {stage}, stop {stop}"
            try:
                for step in range(3):
                    x, y = _data(step, rank)
                    engine.backward(F.mse_loss(engine(x), y))
                    engine.step()
            except FloatingPointError as err:
                if not (
                    stop and step == BAD_STEP and "0.weight" in str(err) and f"step {BAD_STEP}" in str(err)
                ):
                    raise AssertionError(f"rank {rank}: {case}: {err}") from err
                done.append(case)
                engine.destroy()
                continue
            if stop:
                raise AssertionError(f"rank {rank}: {case}: no FloatingPointError")
            if engine.skipped_steps != 1 or engine.global_steps != 3:
                raise AssertionError(
                    f"rank {rank}: {case}: {engine.skipped_steps} skipped, {engine.global_steps}"
                )
            with engine.gathered_parameters():
                for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                    if not bool(torch.isfinite(p).all()) or ((p - q).norm() / q.norm()).item() > 1e-6:
                        raise AssertionError(
                            f"rank {rank}: {case}: weights differ from the run without the batch"
                        )
            engine.destroy()
            done.append(case)
    return done


def test_nonfinite_loss_skips_the_step_or_stops() -> None:
    assert len(run_distributed(worker, 2)[0]) == 6
