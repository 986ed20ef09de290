"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` (zeroshard/deepspeed/utils/tensor_fragment.py) at
stages 1-3, W=2, and with hybrid sharding (``mics_shard_size`` 2 of W=4): the parameter, its gradient and
AdamW's two moments against one process training on every rank's batches; setters read back; errors named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from zeroshard.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)

pytestmark = pytest.mark.timeout(300)

STEPS, LR = 3, 1e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)


def _reference(world: int) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], nn.Module]:
    """One process on every rank's batches: parameters and AdamW state after ``STEPS`` steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        xs, ys = zip(*(_batch(step, r) for r in range(world)), strict=True)
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    names = dict(model.named_parameters())
    states = {n: {k: v for k, v in opt.state[p].items() if k != "step"} for n, p in names.items()}
    return {n: p.detach().clone() for n, p in names.items()}, states, model


def _close(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def _case(rank: int, world: int, zero: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.0,  # the reference does not clip
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {**zero, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=_model(), config=config)
    params = dict(engine.module.named_parameters())
    try:
        safe_get_full_optimizer_state(params["0.weight"], "exp_avg")
        problems.append(f"{zero}: state read before the first step")
    except ValueError as err:
        if "first step" not in str(err):
            problems.append(f"{zero}: {err}")
    for step in range(STEPS):
        x, y = _batch(step, rank)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    want_params, want_states, _ = _reference(world)
    for name, param in params.items():
        if not _close(safe_get_full_fp32_param(param), want_params[name]):
            problems.append(f"{zero} {name}: fp32 parameter")
        for key in ("exp_avg", "exp_avg_sq"):
            if not _close(safe_get_full_optimizer_state(param, key), want_states[name][key]):
                problems.append(f"{zero} {name}: {key}")
    # Setters: every rank writes its pieces of the same value; the getter reads it back.
    param, shape = params["2.weight"], want_params["2.weight"].shape  # at stage 3 the parameter is released
    value = torch.arange(shape.numel(), dtype=torch.float32).reshape(shape)
    safe_set_full_optimizer_state(param, value, "exp_avg")
    if not torch.equal(safe_get_full_optimizer_state(param, "exp_avg"), value):
        problems.append(f"{zero}: exp_avg set and read back")
    try:
        safe_get_full_optimizer_state(param, "momentum_buffer")
        problems.append(f"{zero}: an unknown state key was read")
    except ValueError as err:
        if "exp_avg" not in str(err):
            problems.append(f"{zero}: the error does not name the keys: {err}")
    x, y = _batch(STEPS, rank)
    engine.backward(nn.functional.mse_loss(engine(x), y))
    grad = safe_get_full_grad(param)
    if grad is None or grad.shape != shape or not grad.abs().sum() > 0:
        problems.append(f"{zero}: gradient after backward: {grad}")
    safe_set_full_grad(param, value)
    if not torch.equal(safe_get_full_grad(param), value):
        problems.append(f"{zero}: gradient set and read back")
    engine.destroy()
    return problems


def worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[str]:
    return [p for zero in cases for p in _case(rank, world_size, zero)]


def test_stages_1_to_3_at_w2() -> None:
    cases = [{"stage": s} for s in (1, 2, 3)]
    assert run_distributed(worker, 2, cases, timeout=280) == [[], []]


def test_hybrid_sharding_at_w4() -> None:
    cases = [{"stage": s, "mics_shard_size": 2} for s in (2, 3)]
    assert run_distributed(worker, 4, cases, timeout=280) == [[]] * 4
