"""``deepspeed.runtime.zero.unwrap_model_for_generation`` (DeepSpeed's helper for RLHF generation): at W=2,
stage 3 (and stage 2, where it changes nothing), the block sees every parameter whole and its forward
equals one process's model; training after the block is bit-identical to training without it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import run_distributed
from tests.models import batch, make_model
from zeroshard.deepspeed import initialize
from zeroshard.deepspeed.runtime.zero import unwrap_model_for_generation

pytestmark = pytest.mark.timeout(200)


def _train(engine: Any, steps: range, rank: int) -> None:
    for step in steps:
        engine.backward(engine(*batch(step, 0, rank)))
        engine.step()


def _run(rank: int, stage: int, unwrap: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    problems: list[str] = []
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = initialize(model=make_model(0), config=config)
    _train(engine, range(2), rank)
    if unwrap:
        probe = batch(99, 0, 0)
        reference = make_model(0)
        reference.load_state_dict(engine.full_state_dict())
        whole = {n: tuple(p.shape) for n, p in reference.named_parameters()}
        with unwrap_model_for_generation(engine) as unwrapped:
            if unwrapped is not engine:
                problems.append(f"stage {stage}: the block yields {type(unwrapped).__name__}, not the engine")
            shapes = {n: tuple(p.shape) for n, p in engine.module.named_parameters()}
            if shapes != whole:
                problems.append(f"stage {stage}: parameters inside the block: {shapes}")
            with torch.no_grad():
                out = engine.module(*probe)
            if not torch.allclose(out, reference(*probe).detach(), rtol=1e-6, atol=1e-7):
                problems.append(f"stage {stage}: the block's forward differs from the whole model's")
    _train(engine, range(2, 4), rank)
    state = engine.full_state_dict()
    engine.destroy()
    return state, problems


def worker(rank: int, world_size: int) -> list[str]:
    problems: list[str] = []
    for stage in (3, 2):
        plain, _ = _run(rank, stage, unwrap=False)
        unwrapped, found = _run(rank, stage, unwrap=True)
        problems += found
        for name, value in plain.items():
            if not torch.equal(value, unwrapped[name]):
                problems.append(f"stage {stage} {name}: training after the block differs")
    with pytest.raises(TypeError, match=r"the engine deepspeed\.initialize returned"):
        with unwrap_model_for_generation(make_model(0)):
            pass
    return problems


def test_unwrap_model_for_generation_at_w2() -> None:
    assert run_distributed(worker, 2, timeout=180) == [[], []]
