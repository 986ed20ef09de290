"""``engine.scale(loss)`` and ``engine.empty_partition_cache()``, DeepSpeed's engine methods.

``engine.scale(loss).backward(); engine.step()`` gives the update ``engine.backward(loss); engine.step()``
gives, in fp32 with gradient accumulation and in fp16 (where the loss is multiplied by the loss scale before
backward, so fp16 gradients do not underflow; the step divides it out once). In fp16 with accumulation a
plain backward adds the micro-batches' gradients in fp16 in ``param.grad`` (``engine.backward`` adds them
in its fp32 buffers), so there the reference is a plain ``loss.backward()``, which the step scales itself.
``empty_partition_cache()`` between steps frees the buffers kept for gathering and changes no result."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import batch, make_model
from zeroshard.deepspeed import initialize

pytestmark = pytest.mark.timeout(300)


def _engine(stage: int, precision: str, gas: int, optimizer: bool = True) -> Any:
    model = make_model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _train(rank: int, stage: int, precision: str, gas: int, how: str) -> dict[str, torch.Tensor]:
    engine = _engine(stage, precision, gas)
    for step in range(2):
        for micro in range(gas):
            loss = engine(*batch(step, micro, rank))
            if how == "scale":
                scaled = engine.scale(loss)
                expected = 2.0**8 if precision == "fp16" else 1.0
                assert torch.equal(scaled.detach(), loss.detach() * expected)
                scaled.backward()
            elif how == "plain":
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        if how == "empty_cache":
            engine.empty_partition_cache()
            assert engine.reducer.pool.idle_bytes == 0
    with engine.gathered_parameters():
        state = {k: v.detach().float().clone() for k, v in engine.module.named_parameters()}
    engine.destroy()
    return state


def _worst(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)


def worker(rank: int, world_size: int) -> list[str]:
    report = []
    for stage, precision, gas, reference in (
        (1, "fp32", 2, "backward"),
        (3, "fp32", 2, "backward"),
        (2, "fp16", 1, "backward"),
        (2, "fp16", 2, "plain"),
    ):
        ref = _train(rank, stage, precision, gas, reference)
        for how in ("scale",) if reference == "plain" else ("scale", "empty_cache"):
            worst = _worst(_train(rank, stage, precision, gas, how), ref)
            if not worst <= 1e-6:
                raise AssertionError(f"rank {rank}: stage {stage} {precision} {how}: {worst:.1e} off")
            report.append(f"{stage}/{precision}/{gas}/{how}")
    engine = _engine(1, "fp16", 2)
    loss = engine(*batch(0, 0, rank))
    with pytest.raises(ValueError, match="scalar") as info:
        engine.scale(loss.expand(3))
    assert isinstance(info.value, AssertionError)
    with pytest.raises(ValueError, match="does not require grad"):
        engine.scale(loss.detach())
    # The micro-batches of one window must all go through scale() or none of them.
    engine.scale(loss).backward()
    engine.step()
    engine(*batch(0, 1, rank)).backward()
    with pytest.raises(ValueError, match="scale"):
        engine.step()
    no_optimizer = _engine(1, "fp32", 1, optimizer=False)
    with pytest.raises(RuntimeError, match="optimizer") as info:
        no_optimizer.scale(no_optimizer(*batch(0, 0, rank)))
    assert isinstance(info.value, AssertionError)
    return report


def test_scale_then_backward_equals_engine_backward_and_empty_cache_changes_nothing() -> None:
    assert len(run_distributed(worker, 2)[0]) == 7
