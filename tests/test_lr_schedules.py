"""Tests for zeroshard.lr_schedules: DeepSpeed's lr sequences, torch schedulers by name, errors.

The ``_ds_*`` functions below are DeepSpeed's formulas (deepspeed/runtime/lr_schedules.py), written
out independently of zeroshard's classes, with DeepSpeed's arithmetic order so results are
bitwise equal. DeepSpeed applies the lr of iteration -1 at construction and the lr of iteration
k-1 after the k-th ``step()``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

STEPS = 30

# ---------------------------------------------------------------------------------------------
# DeepSpeed's formulas, per iteration ``i`` (-1 = at construction)


def _ds_warmup_gamma(i: int, warmup_num_steps: int, warmup_type: str) -> float:
    steps = max(2, warmup_num_steps)
    if warmup_type == "log":
        return (1.0 / math.log(steps)) * math.log(i + 1)
    return i / steps


def _ds_warmup_lr(i: int, min_lr: float, max_lr: float, warmup_num_steps: int, warmup_type: str) -> float:
    if i < 0:
        return min_lr
    gamma = _ds_warmup_gamma(i, warmup_num_steps, warmup_type) if i < max(2, warmup_num_steps) else 1.0
    return min_lr + ((max_lr - min_lr) * gamma)


def _ds_warmup_decay_lr(
    i: int, min_lr: float, max_lr: float, warmup: int, total: int, warmup_type: str
) -> float:
    if i < 0:
        return min_lr
    steps = max(2, warmup)
    if i < steps:
        gamma = _ds_warmup_gamma(i, warmup, warmup_type)
    else:
        gamma = max(0.0, float(total - i) / float(max(1.0, total - steps)))
    return min_lr + ((max_lr - min_lr) * gamma)


def _ds_warmup_cosine_lr(
    i: int,
    org_lr: float,
    total: int,
    warmup_min_ratio: float,
    warmup: int,
    cos_min_ratio: float,
    warmup_type: str,
) -> float:
    if i < 0:
        return 0.0
    steps = max(2, warmup)
    if i < steps:
        ratio = _ds_warmup_gamma(i, warmup, warmup_type)
        ratio = warmup_min_ratio + ratio * (1.0 - warmup_min_ratio)
    else:
        progress = min(1.0, (i - steps + 1) / max(1, total - steps))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        ratio = max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * ratio)
    return org_lr * ratio


def _ds_range_test_lr(i: int, min_lr: float, step_size: int, step_rate: float, staircase: bool) -> float:
    interval = math.floor(float(i + 1) / step_size) if staircase else float(i + 1) / step_size
    return min_lr * (1 + step_rate * interval)


def _ds_one_cycle_scale(i: int, first: float, second: float, first_stairs: int, second_stairs: int) -> float:
    total = first + second
    ratio = first / total
    batch = i + 1
    cycle = math.floor(1 + batch / total)
    x = 1.0 + batch / total - cycle
    if x <= ratio:
        scale, stairs = x / ratio, first_stairs
    else:
        scale, stairs = (x - 1) / (ratio - 1), second_stairs
    if stairs > 0:
        offset = batch % total
        position = offset * stairs / first if offset <= first else (total - offset) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def _ds_one_cycle(i: int, c: dict[str, Any]) -> tuple[float, float]:
    """(lr, beta1) at iteration ``i`` for the OneCycle config ``c`` (all keys given)."""
    first = float(c["cycle_first_step_size"])
    second = float(c["cycle_second_step_size"])
    total = first + second
    if i < 0:
        return c["cycle_min_lr"], c["cycle_min_mom"]
    if i < total:
        scale = _ds_one_cycle_scale(
            i, first, second, c["cycle_first_stair_count"], c["cycle_second_stair_count"]
        )
        lr = c["cycle_min_lr"] + (c["cycle_max_lr"] - c["cycle_min_lr"]) * scale
        mom = c["cycle_max_mom"] - (c["cycle_max_mom"] - c["cycle_min_mom"]) * scale
        return lr, mom
    decay_iteration = i - total + 1
    interval = decay_iteration / c["decay_step_size"]
    lr = c["cycle_min_lr"] / (1 + c["decay_lr_rate"] * interval)
    mom = c["cycle_max_mom"] * (1 + c["decay_mom_rate"] * interval)
    return lr, mom


# ---------------------------------------------------------------------------------------------
# Helpers


def _optimizer(
    lrs: tuple[float, ...] = (0.1, 0.3), cls: type[torch.optim.Optimizer] = torch.optim.AdamW
) -> torch.optim.Optimizer:
    groups = [{"params": [torch.zeros(2)], "lr": lr} for lr in lrs]
    return cls(groups, lr=lrs[0])  # type: ignore[call-arg]


def _lr_sequence(scheduler: LRScheduler, steps: int = STEPS) -> list[list[float]]:
    """Group lrs at construction and after each of ``steps`` optimizer + scheduler steps."""
    optimizer = scheduler.optimizer
    sequence = [[g["lr"] for g in optimizer.param_groups]]
    for _ in range(steps):
        optimizer.step()  # no grads: a no-op that keeps torch's step-order check quiet
        scheduler.step()
        sequence.append([g["lr"] for g in optimizer.param_groups])
    return sequence


def _expected(per_group: list[Callable[[int], float]], steps: int = STEPS) -> list[list[float]]:
    return [[f(i) for f in per_group] for i in range(-1, steps)]


# ---------------------------------------------------------------------------------------------
# DeepSpeed schedules reproduce DeepSpeed's sequences


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr(warmup_type: str) -> None:
    params = {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 12, "warmup_type": warmup_type}
    scheduler = build_scheduler("WarmupLR", params, _optimizer())
    assert _lr_sequence(scheduler) == _expected([lambda i: _ds_warmup_lr(i, 0.01, 0.2, 12, warmup_type)] * 2)


def test_warmup_lr_per_group_lists_and_default_max_from_groups() -> None:
    lists = build_scheduler(
        "WarmupLR", {"warmup_min_lr": [0.0, 0.01], "warmup_max_lr": [0.1, 0.5]}, _optimizer()
    )
    assert _lr_sequence(lists) == _expected(
        [
            lambda i: _ds_warmup_lr(i, 0.0, 0.1, 1000, "log"),
            lambda i: _ds_warmup_lr(i, 0.01, 0.5, 1000, "log"),
        ]
    )
    # warmup_max_lr omitted: each group warms up to its own lr (DeepSpeed PR #8171).
    default_max = build_scheduler("WarmupLR", {"warmup_num_steps": 5}, _optimizer((0.1, 0.3)))
    assert _lr_sequence(default_max) == _expected(
        [lambda i: _ds_warmup_lr(i, 0.0, 0.1, 5, "log"), lambda i: _ds_warmup_lr(i, 0.0, 0.3, 5, "log")]
    )


def test_warmup_lr_with_one_warmup_step_uses_two() -> None:
    scheduler = build_scheduler(
        "WarmupLR", {"warmup_num_steps": 1, "warmup_type": "linear"}, _optimizer((0.1,))
    )
    assert _lr_sequence(scheduler, 4) == _expected([lambda i: _ds_warmup_lr(i, 0.0, 0.1, 1, "linear")], 4)


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type: str) -> None:
    params = {
        "total_num_steps": 25,
        "warmup_min_lr": 0.001,
        "warmup_num_steps": 8,
        "warmup_type": warmup_type,
    }
    scheduler = build_scheduler("WarmupDecayLR", params, _optimizer())
    # warmup_max_lr defaults to 0.001 here (DeepSpeed's WarmupDecayLR signature), not the group lr.
    default_max = [lambda i: _ds_warmup_decay_lr(i, 0.001, 0.001, 8, 25, warmup_type)] * 2
    assert _lr_sequence(scheduler) == _expected(default_max)
    with_max = build_scheduler("WarmupDecayLR", {**params, "warmup_max_lr": 0.05}, _optimizer())
    sequence = _lr_sequence(with_max)
    assert sequence == _expected([lambda i: _ds_warmup_decay_lr(i, 0.001, 0.05, 8, 25, warmup_type)] * 2)
    assert sequence[-1] == [0.001, 0.001]  # past total_num_steps: gamma 0, back to warmup_min_lr


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type: str) -> None:
    params = {
        "total_num_steps": 24,
        "warmup_min_ratio": 0.1,
        "warmup_num_steps": 7,
        "cos_min_ratio": 0.05,
        "warmup_type": warmup_type,
    }
    scheduler = build_scheduler("WarmupCosineLR", params, _optimizer((0.1, 0.3)))
    assert _lr_sequence(scheduler) == _expected(
        [
            partial(
                _ds_warmup_cosine_lr,
                org_lr=lr,
                total=24,
                warmup_min_ratio=0.1,
                warmup=7,
                cos_min_ratio=0.05,
                warmup_type=warmup_type,
            )
            for lr in (0.1, 0.3)
        ]
    )


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    params = {
        "lr_range_test_min_lr": [0.01, 0.02],
        "lr_range_test_step_size": 5,
        "lr_range_test_step_rate": 0.5,
        "lr_range_test_staircase": staircase,
    }
    scheduler = build_scheduler("LRRangeTest", params, _optimizer())
    assert _lr_sequence(scheduler) == _expected(
        [
            partial(_ds_range_test_lr, min_lr=lr, step_size=5, step_rate=0.5, staircase=staircase)
            for lr in (0.01, 0.02)
        ]
    )


_ONE_CYCLE = {
    "cycle_min_lr": 0.01,
    "cycle_max_lr": 0.1,
    "decay_lr_rate": 0.5,
    "cycle_first_step_size": 7,
    "cycle_second_step_size": 5,
    "cycle_first_stair_count": 0,
    "cycle_second_stair_count": 0,
    "decay_step_size": 3,
    "cycle_momentum": True,
    "cycle_min_mom": 0.85,
    "cycle_max_mom": 0.95,
    "decay_mom_rate": 0.1,
}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cycle_first_stair_count": 3, "cycle_second_stair_count": 2},
        {
            "cycle_first_step_size": 6,
            "cycle_second_step_size": 6,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 4,
        },
    ],
)
def test_one_cycle_lr_and_momentum(overrides: dict[str, Any]) -> None:
    config = _ONE_CYCLE | overrides
    optimizer = _optimizer((0.5, 0.5))
    scheduler = build_scheduler("OneCycle", config, optimizer)
    lrs, betas = [], []
    for step in range(STEPS + 1):
        if step:
            optimizer.step()
            scheduler.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
        betas.append([g["betas"] for g in optimizer.param_groups])
    expected = [_ds_one_cycle(i, config) for i in range(-1, STEPS)]
    assert lrs == [[lr, lr] for lr, _ in expected]
    # DeepSpeed writes (beta1, 0.99) into every group: beta2 becomes 0.99 whatever it was.
    assert betas == [[(mom, 0.99), (mom, 0.99)] for _, mom in expected]


def test_one_cycle_per_group_values_get_mom_and_a_rising_only_cycle() -> None:
    """One value per param group for the cycle's lr and momentum bounds, each group on its own DeepSpeed
    curve; ``get_mom()`` as DeepSpeed's (the formula also at -1); ``cycle_second_step_size`` 0."""
    per_group = {"cycle_min_lr": [0.01, 0.02], "cycle_max_lr": [0.1, 0.3]}
    per_group |= {"cycle_min_mom": [0.85, 0.8], "cycle_max_mom": [0.95, 0.9]}
    config = _ONE_CYCLE | per_group
    optimizer = _optimizer((0.5, 0.5))
    scheduler = build_scheduler("OneCycle", config, optimizer)
    assert isinstance(scheduler, OneCycle)
    each = [{**config, **{key: value[g] for key, value in per_group.items()}} for g in range(2)]
    for i in range(-1, STEPS):
        if i >= 0:
            optimizer.step()
            scheduler.step()
        expected = [_ds_one_cycle(i, c) for c in each]
        assert [g["lr"] for g in optimizer.param_groups] == [lr for lr, _ in expected]
        assert [g["betas"] for g in optimizer.param_groups] == [(mom, 0.99) for _, mom in expected]
        # Before the first step DeepSpeed's get_mom() evaluates the cycle at batch 0 (scale 0: max_mom),
        # while the constructor has set min_mom.
        moms = [c["cycle_max_mom"] for c in each] if i < 0 else [mom for _, mom in expected]
        assert scheduler.get_mom() == [(mom, 0.99) for mom in moms]
    rising = build_scheduler("OneCycle", {**_ONE_CYCLE, "cycle_second_step_size": 0}, _optimizer())
    assert isinstance(rising, OneCycle) and rising.step_ratio == 1.0
    lrs = [lr for lr, _ in _lr_sequence(rising, 8)]
    # It rises over cycle_first_step_size (7) iterations; there is no falling half.
    assert lrs[0] == pytest.approx(0.01) and all(b > a for a, b in itertools.pairwise(lrs[:7]))


def test_warmup_cosine_lr_ratio_and_an_unknown_warmup_type(caplog: pytest.LogCaptureFixture) -> None:
    """``get_lr_ratio()`` is the factor on the groups' initial lrs (0 before the first step); a warmup_type
    other than "log" or "linear" warns and warms up as "log", as DeepSpeed does."""
    params = {"total_num_steps": 24, "warmup_num_steps": 7, "warmup_min_ratio": 0.1}
    with caplog.at_level(logging.WARNING, logger="zeroshard.lr_schedules"):
        odd = build_scheduler("WarmupCosineLR", params | {"warmup_type": "cosine"}, _optimizer((0.1, 0.3)))
    assert "warmup_type 'cosine' is not 'log' or 'linear': using 'log'" in caplog.text
    plain = build_scheduler("WarmupCosineLR", params, _optimizer((0.1, 0.3)))
    assert isinstance(odd, WarmupCosineLR) and isinstance(plain, WarmupCosineLR)
    assert odd.get_lr_ratio() == 0.0
    assert _lr_sequence(odd) == _lr_sequence(plain)
    assert odd.get_lr_ratio() == plain.get_lr_ratio() > 0
    assert [g["lr"] for g in odd.optimizer.param_groups] == [
        0.1 * odd.get_lr_ratio(),
        0.3 * odd.get_lr_ratio(),
    ]


def test_one_cycle_defaults_and_no_decay() -> None:
    scheduler = build_scheduler(
        "OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4}, _optimizer()
    )
    config = _ONE_CYCLE | {
        "cycle_first_step_size": 4,
        "cycle_second_step_size": 4,
        "decay_lr_rate": 0.0,
        "decay_mom_rate": 0.0,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
    }
    expected = [_ds_one_cycle(i, config)[0] for i in range(-1, 8)] + [0.01] * (STEPS - 8)
    assert _lr_sequence(scheduler) == [[lr, lr] for lr in expected]
    assert scheduler.optimizer.param_groups[0]["betas"] == (0.9, 0.99)  # decay phase without decay: max_mom


def test_one_cycle_without_betas_keeps_momentum(caplog: pytest.LogCaptureFixture) -> None:
    optimizer = torch.optim.SGD([torch.zeros(2)], lr=0.1, momentum=0.9)
    with caplog.at_level(logging.WARNING, logger="zeroshard.lr_schedules"):
        scheduler = build_scheduler("OneCycle", _ONE_CYCLE, optimizer)
    assert "cycle_momentum: disabled" in caplog.text
    assert _lr_sequence(scheduler) == [[_ds_one_cycle(i, _ONE_CYCLE)[0]] for i in range(-1, STEPS)]
    assert optimizer.param_groups[0]["momentum"] == 0.9 and "betas" not in optimizer.param_groups[0]


def test_one_cycle_accepts_float_step_sizes_like_deepspeed() -> None:
    ints = {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.1,
        "cycle_first_step_size": 10,
        "cycle_second_step_size": 6,
    }
    floats = ints | {"cycle_first_step_size": 1e1, "cycle_second_step_size": 6.0}  # JSON 1e1 is a float
    assert _lr_sequence(build_scheduler("OneCycle", floats, _optimizer())) == _lr_sequence(
        build_scheduler("OneCycle", ints, _optimizer())
    )


# ---------------------------------------------------------------------------------------------
# torch integration: state_dict, resume, get_last_lr


_DS_CONFIGS = [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.2, "warmup_num_steps": 12}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_max_lr": 0.05, "warmup_num_steps": 8}),
    ("WarmupCosineLR", {"total_num_steps": 24, "warmup_num_steps": 7, "warmup_min_ratio": 0.1}),
    ("OneCycle", _ONE_CYCLE),
    ("LRRangeTest", {"lr_range_test_step_size": 5}),
]


@pytest.mark.parametrize(("type_name", "params"), _DS_CONFIGS)
def test_is_a_torch_scheduler_with_last_lr(type_name: str, params: dict[str, Any]) -> None:
    scheduler = build_scheduler(type_name, params, _optimizer())
    assert isinstance(scheduler, LRScheduler)
    for _ in range(3):
        scheduler.optimizer.step()
        scheduler.step()
        assert scheduler.get_last_lr() == [g["lr"] for g in scheduler.optimizer.param_groups]
    assert scheduler.last_batch_iteration == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(("type_name", "params"), _DS_CONFIGS)
def test_state_dict_round_trip(type_name: str, params: dict[str, Any]) -> None:
    first_optimizer = _optimizer()
    first = build_scheduler(type_name, params, first_optimizer)
    _lr_sequence(first, 11)
    saved_scheduler, saved_optimizer = first.state_dict(), first_optimizer.state_dict()
    assert saved_scheduler["last_batch_iteration"] == 10

    second_optimizer = _optimizer()
    second = build_scheduler(type_name, params, second_optimizer)
    second.load_state_dict(saved_scheduler)
    second_optimizer.load_state_dict(saved_optimizer)
    assert _lr_sequence(second, 15) == _lr_sequence(first, 15)


@pytest.mark.parametrize(("type_name", "params"), _DS_CONFIGS)
def test_loads_a_deepspeed_state_dict_and_resumes_by_parameter(
    type_name: str, params: dict[str, Any]
) -> None:
    reference = build_scheduler(type_name, params, _optimizer())
    sequence = _lr_sequence(reference, 20)

    from_ds = build_scheduler(type_name, params, _optimizer())
    from_ds.load_state_dict({"last_batch_iteration": 9})  # what DeepSpeed's state_dict() holds
    assert _lr_sequence(from_ds, 10)[1:] == sequence[11:]

    # last_batch_iteration=L applies the lr of iteration L at once, then continues.
    resumed = build_scheduler(type_name, params | {"last_batch_iteration": 9}, _optimizer())
    assert _lr_sequence(resumed, 10) == sequence[10:]


def test_direct_construction_matches_factory() -> None:
    cases: list[tuple[type[LRScheduler], dict[str, Any]]] = [
        (WarmupLR, {"warmup_max_lr": 0.1, "warmup_num_steps": 5}),
        (WarmupDecayLR, {"total_num_steps": 10, "warmup_num_steps": 5}),
        (WarmupCosineLR, {"total_num_steps": 10, "warmup_num_steps": 5}),
        (LRRangeTest, {"lr_range_test_step_size": 3}),
        (OneCycle, {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
    ]
    for cls, kwargs in cases:
        direct = cls(_optimizer(), **kwargs)  # type: ignore[arg-type]
        built = build_scheduler(cls.__name__, kwargs, _optimizer())
        assert _lr_sequence(direct, 12) == _lr_sequence(built, 12)


# ---------------------------------------------------------------------------------------------
# torch schedulers by name


@pytest.mark.parametrize(
    ("type_name", "params", "make"),
    [
        ("StepLR", {"step_size": 3, "gamma": 0.5}, lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)),
        ("steplr", {"step_size": 3}, lambda o: torch.optim.lr_scheduler.StepLR(o, 3)),
        (
            "CosineAnnealingLR",
            {"T_max": 10, "eta_min": 0},
            lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
        ),
        ("MultiStepLR", {"milestones": [2, 5]}, lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5])),
        (
            "LinearLR",
            {"start_factor": 0.5, "total_iters": 4},
            lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.5, total_iters=4),
        ),
        (
            "OneCycleLR",
            {"max_lr": [0.2, 0.4], "total_steps": 40},
            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, [0.2, 0.4], total_steps=40),
        ),
    ],
)
def test_torch_scheduler_by_name(
    type_name: str, params: dict[str, Any], make: Callable[[Any], LRScheduler]
) -> None:
    built = build_scheduler(type_name, params, _optimizer())
    direct = make(_optimizer())
    assert type(built) is type(direct)
    assert _lr_sequence(built) == _lr_sequence(direct)


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("type_name", "params", "error", "fragments"),
    [
        ("WarmupLr", {}, None, []),  # case-insensitive: not an error
        ("Warmup", {}, ValueError, ["scheduler.type", "'Warmup'", "did you mean 'WarmupLR'", "StepLR"]),
        ("OneCycl", {}, ValueError, ["did you mean 'OneCycle'"]),
        (
            "WarmupLR",
            {"warmup_num_step": 5},
            ValueError,
            [
                "scheduler.params.warmup_num_step",
                "WarmupLR",
                "did you mean 'warmup_num_steps'",
                "warmup_type",
            ],
        ),
        (
            "StepLR",
            {"step_sise": 5},
            ValueError,
            ["scheduler.params.step_sise", "StepLR", "did you mean 'step_size'"],
        ),
        ("WarmupDecayLR", {}, ValueError, ["scheduler.params.total_num_steps", "missing"]),
        ("WarmupCosineLR", {"warmup_num_steps": 5}, ValueError, ["scheduler.params.total_num_steps"]),
        ("OneCycle", {"cycle_min_lr": 0.1}, ValueError, ["scheduler.params.cycle_max_lr"]),
        ("StepLR", {}, ValueError, ["scheduler.params.step_size"]),
        ("LambdaLR", {}, ValueError, ["'LambdaLR' cannot be built from a config", "callable", "Available"]),
        ("ReduceLROnPlateau", {}, ValueError, ["metric"]),
        ("SequentialLR", {}, ValueError, ["scheduler objects"]),
        ("WarmupLR", {"warmup_num_steps": 10.0}, TypeError, ["scheduler.params.warmup_num_steps", "integer"]),
        ("WarmupLR", {"warmup_num_steps": 0}, ValueError, ["scheduler.params.warmup_num_steps", ">= 1"]),
        (
            "WarmupLR",
            {"warmup_type": 3},
            ValueError,
            ["scheduler.params.warmup_type", "'log'", "'linear'", "3"],
        ),
        (
            "WarmupLR",
            {"warmup_num_steps": None},
            ValueError,
            ["scheduler.params.warmup_num_steps", "integer"],
        ),
        ("WarmupLR", {"warmup_max_lr": "auto"}, TypeError, ["scheduler.params.warmup_max_lr", "number"]),
        (
            "WarmupLR",
            {"warmup_min_lr": [0.0, 0.1, 0.2]},
            ValueError,
            ["scheduler.params.warmup_min_lr", "2 values"],
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": [0.2, 0.3, 0.4]},
            ValueError,
            ["scheduler.params.cycle_max_lr", "2 values"],
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_min_mom": ["a", 0.8]},
            TypeError,
            ["scheduler.params.cycle_min_mom[0]"],
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_momentum": "no"},
            TypeError,
            ["cycle_momentum"],
        ),
        (
            "OneCycle",
            {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_second_step_size": -1},
            ValueError,
            ["scheduler.params.cycle_second_step_size", ">= 0"],
        ),
        (
            "LRRangeTest",
            {"lr_range_test_staircase": 1},
            TypeError,
            ["scheduler.params.lr_range_test_staircase"],
        ),
        ("WarmupLR", {"last_batch_iteration": -2}, ValueError, ["scheduler.params.last_batch_iteration"]),
        ("StepLR", {"step_size": "3"}, TypeError, ["scheduler.params.step_size", "integer"]),
        ("LinearLR", {"start_factor": 2.0}, ValueError, ["scheduler.params", "LinearLR"]),
        (None, {}, TypeError, ["scheduler.type"]),
    ],
)
def test_errors(
    type_name: Any, params: dict[str, Any], error: type[Exception] | None, fragments: list[str]
) -> None:
    if error is None:
        build_scheduler(type_name, params, _optimizer())
        return
    with pytest.raises(error) as info:
        build_scheduler(type_name, params, _optimizer())
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
