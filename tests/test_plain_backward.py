"""PyTorch-style ``loss.backward(); engine.step()`` gives the update ``engine.backward(loss); engine.step()``
gives, at stages 0-3, with and without gradient accumulation (the gradients are scaled by
1 / gradient_accumulation_steps at the boundary, as ``engine.backward`` scales the loss)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model

pytestmark = pytest.mark.timeout(300)


def _train(rank: int, stage: int, gas: int, plain: bool) -> dict[str, torch.Tensor]:
    model = make_model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(2):
        for micro in range(gas):
            x, y = batch(step, micro, rank)
            loss = engine(x, y)
            if plain:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
    with engine.gathered_parameters():
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
    engine.destroy()
    return state


def worker(rank: int, world_size: int) -> list[str]:
    report = []
    for stage in (0, 1, 2, 3):
        for gas in (1, 2):
            ref = _train(rank, stage, gas, plain=False)
            got = _train(rank, stage, gas, plain=True)
            worst = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
            if not worst <= 1e-6:
                raise AssertionError(
                    f"rank {rank}: stage {stage}, gas {gas}: loss.backward() is {worst:.1e} off"
                )
            report.append(f"{stage}/{gas}")
    return report


def test_loss_backward_then_step_equals_engine_backward() -> None:
    assert len(run_distributed(worker, 2)[0]) == 8


def test_zero_grad_set_to_none_false_zeroes_in_place() -> None:
    """World size 1, in process: gradients a plain ``loss.backward()`` left are zeroed, not dropped."""
    model = make_model()
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    engine(*batch(0, 0, 0)).backward()
    with_grad = [p for p in model.parameters() if p.grad is not None]
    assert with_grad and any(bool(p.grad.abs().sum() > 0) for p in with_grad)
    engine.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in with_grad)
    engine.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    engine.destroy()


def test_optimizer_step_outside_engine_step_is_refused() -> None:
    """The optimizer initialize() returns steps only inside engine.step() (which reduces, unscales and clips
    first): called directly, as Lightning Fabric does, it raises instead of silently changing nothing."""
    model = make_model()
    engine, optimizer, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    engine.backward(engine(*batch(0, 0, 0)))
    with pytest.raises(RuntimeError, match=r"call engine.step\(\) instead"):
        optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    engine.step()  # the step still happens, once, through the engine
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    engine.destroy()
