"""Exceptions keep the types callers catch.

Raised inside the model, they reach the caller as torch raised them, at every stage: the engine may add a
note, never replace the exception (``except torch.OutOfMemoryError`` in a training script keeps working,
and so does any handler keyed on torch's type). Raised by zeroshard where DeepSpeed raises
``AssertionError``, ``ValueError`` or ``DeepSpeedConfigError`` for the same misuse, they are also of
DeepSpeed's type ([Note: DeepSpeed's exception types] in zeroshard/errors.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
import zeroshard.deepspeed as deepspeed
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(200)


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail: type[BaseException] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail is not None:
            raise self.fail("raised by the model")
        return self.lin(x).sum()


def worker(rank: int, world_size: int) -> list[str]:
    seen = []
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = Faulty()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        for kind in (torch.OutOfMemoryError, RuntimeError, ValueError):
            model.fail = kind
            try:
                engine(torch.ones(2, 4))
            except BaseException as err:
                if type(err) is not kind or "raised by the model" not in str(err):
                    raise AssertionError(
                        f"stage {stage}: {kind.__name__} arrived as {type(err).__name__}: {err}"
                    ) from err
                seen.append(f"{stage}:{kind.__name__}")
            else:
                raise AssertionError(f"stage {stage}: {kind.__name__} was swallowed")
        model.fail = None
        loss = engine(torch.ones(2, 4))  # the engine still trains after the errors
        engine.backward(loss)
        engine.step()
        engine.destroy()
    return seen


def test_model_exceptions_keep_their_type() -> None:
    seen = run_distributed(worker, 2)[0]
    assert len(seen) == 9


# -- zeroshard's errors are also DeepSpeed's types ([Note: DeepSpeed's exception types], errors.py) ----------


def test_error_classes_derive_from_zeroshards_type_and_deepspeeds() -> None:
    from zeroshard.config import ConfigError, ConfigTypeError
    from zeroshard.errors import ArgumentError, ArgumentTypeError, DeepSpeedConfigError, UsageError

    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, AssertionError)
    assert issubclass(UsageError, RuntimeError) and issubclass(UsageError, AssertionError)
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)
    for cls in (ConfigError, ConfigTypeError):
        assert issubclass(cls, ValueError) and issubclass(cls, DeepSpeedConfigError)
        assert issubclass(cls, AssertionError)
    assert not issubclass(DeepSpeedConfigError, ValueError)  # DeepSpeed's own is a plain Exception
    assert deepspeed.DeepSpeedConfigError is DeepSpeedConfigError
    assert deepspeed.runtime.config.DeepSpeedConfigError is DeepSpeedConfigError


def test_initialize_without_a_model_is_an_assertion_error_too() -> None:
    config = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(ValueError, match="model") as info:
        zeroshard.initialize(model=None, config=config)
    assert isinstance(info.value, AssertionError)
    # DeepSpeed's first positional parameter is args: a model passed there leaves model=None.
    with pytest.raises(AssertionError, match="model"):
        deepspeed.initialize(Faulty(), config=config, dist_init_required=False)


def _raises(kind: type[BaseException], also: type[BaseException], fn: Any, match: str) -> str:
    """Run ``fn``; it must raise an instance of both ``kind`` and ``also`` whose message holds ``match``."""
    try:
        fn()
    except BaseException as err:
        if not (isinstance(err, kind) and isinstance(err, also)) or match not in str(err):
            raise AssertionError(
                f"expected {kind.__name__}+{also.__name__} ({match!r}), got {err!r}"
            ) from err
        return type(err).__name__
    raise AssertionError(f"expected {kind.__name__}+{also.__name__} ({match!r}), nothing was raised")


def _engine(stage: int, **extra: Any) -> Any:
    torch.manual_seed(0)
    model = Faulty()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _enter_no_sync_twice(engine: Any) -> None:
    with engine.no_sync(), engine.no_sync():
        pass


def deepspeed_types_worker(rank: int, world_size: int, save_dir: str) -> list[str]:
    seen = []
    x = torch.full((2, 4), float(rank + 1))
    for stage in (2, 3):  # gradients are reduce-scattered in every backward: no_sync cannot skip that
        engine = _engine(stage)
        seen.append(_raises(RuntimeError, AssertionError, lambda e=engine: e.no_sync().__enter__(), "stage"))
    engine = _engine(1)
    seen.append(_raises(RuntimeError, AssertionError, lambda: _enter_no_sync_twice(engine), "no_sync"))
    with engine.no_sync():
        engine.backward(engine(x))
        seen.append(_raises(RuntimeError, AssertionError, engine.step, "no_sync"))
    engine.backward(engine(x))  # outside the block the boundary backward reduces; the step goes through
    engine.step()
    assert engine.global_steps == 1
    seen.append(_raises(TypeError, ValueError, lambda: engine.save_checkpoint(None), "save_dir"))
    seen.append(_raises(ValueError, ValueError, lambda: engine.save_checkpoint(""), "save_dir"))
    strict = _engine(1, checkpoint={"tag_validation": "FAIL"})
    tag = f"tag-{rank}"
    seen.append(_raises(ValueError, AssertionError, lambda: strict.save_checkpoint(save_dir, tag), "tag"))
    lenient = _engine(1, checkpoint={"tag_validation": "WARN"})
    assert lenient.save_checkpoint(save_dir, tag).endswith("tag-0")  # rank 0's tag, on every rank
    bad = {"train_micro_batch_size_per_gpu": 2, "checkpoint": {"tag_validation": "sometimes"}}
    seen.append(
        _raises(
            deepspeed.DeepSpeedConfigError,
            AssertionError,
            lambda: deepspeed.initialize(model=Faulty(), config=bad),
            "tag_validation",
        )
    )
    return seen


def test_misuse_errors_are_also_deepspeeds_types(tmp_path: Path) -> None:
    seen = run_distributed(deepspeed_types_worker, 2, str(tmp_path))[0]
    assert seen[:2] == ["UsageError", "UsageError"] and len(seen) == 8
