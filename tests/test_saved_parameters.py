"""A custom ``autograd.Function`` that saves a parameter gets that same ``nn.Parameter`` back in backward at
every stage, and trains exactly: TRL's fused LM-head loss saves ``lm_head.weight``, reads ``ds_status`` in
backward and gathers the weight itself (``deepspeed.zero.GatheredParameters``) when ZeRO-3 has released it."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
import zeroshard.deepspeed
from tests.distributed import run_distributed
from tests.models import assert_parameters_close, sgd_reference
from zeroshard.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _gather_if_released(weight: torch.Tensor) -> Any:
    if getattr(weight, "ds_status", ZeroParamStatus.AVAILABLE) != ZeroParamStatus.AVAILABLE:
        return zeroshard.deepspeed.zero.GatheredParameters([weight])
    return contextlib.nullcontext()


class HeadLoss(torch.autograd.Function):
    """``sum(h @ weight.T)`` per row, the gradient computed by hand from the saved parameter."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return (h @ weight.t()).sum(-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, weight = ctx.saved_tensors
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"saved parameter came back as {type(weight).__name__}")
        with _gather_if_released(weight):
            ones = torch.ones(weight.shape[0], dtype=h.dtype)
            grad_h = grad[:, None] * (ones @ weight)[None, :]
        grad_w = ones[:, None] * (grad[:, None] * h).sum(0)[None, :]
        return grad_h, grad_w


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        # The head's weight used outside the head's forward, gathered by the caller, as TRL does.
        with _gather_if_released(self.head.weight):
            out = HeadLoss.apply(h, self.head.weight)
        return F.mse_loss(out, torch.zeros_like(out)) + 0.1 * self.head(h).pow(2).mean()


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def worker(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    ref = sgd_reference(Net(), lambda m, step, r: m(_data(step, r)), STEPS, world_size)
    done = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = Net()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zeroshard.deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        for step in range(STEPS):
            engine.backward(engine(_data(step, rank)))
            engine.step()
        with engine.gathered_parameters():
            assert_parameters_close(model, ref, f"rank {rank}: stage {stage}", 1e-5)
        engine.destroy()
        done.append(f"stage {stage}")
    return done


def test_saved_parameter_comes_back_as_itself() -> None:
    assert len(run_distributed(worker, 2)[0]) == 4
