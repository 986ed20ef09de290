"""Tests for zeroshard.optim_factory and zeroshard.optimizers (no processes needed)."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch

from zeroshard.optim_factory import build_optimizer
from zeroshard.optimizers import DeepSpeedAdam, DeepSpeedCPUAdam, FusedAdam, Lamb, Lion

# ---------------------------------------------------------------------------------------------
# Helpers


def _groups(*sizes: int) -> list[dict[str, Any]]:
    """One param group of 1-D leaf tensors that do not require grad, like the engine's slices."""
    return [{"params": [torch.randn(n) for n in sizes]}]


def _set_grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


# ---------------------------------------------------------------------------------------------
# Type and parameter mapping


@pytest.mark.parametrize(
    ("type_name", "params", "expected_cls", "expected"),
    [
        ("Adam", {}, FusedAdam, {"weight_decay": 0.0, "lr": 1e-3, "amsgrad": False, "fused": True}),
        ("adam", {"adam_w_mode": True, "weight_decay": 0.1}, FusedAdam, {"decoupled_weight_decay": True}),
        ("Adam", {"adam_w_mode": False, "weight_decay": 0.1}, FusedAdam, {"decoupled_weight_decay": False}),
        ("AdamW", {}, FusedAdam, {"weight_decay": 0.0, "adam_w_mode": True, "bias_correction": True}),
        ("ADAMW", {"lr": 3e-4, "betas": [0.8, 0.95]}, FusedAdam, {"lr": 3e-4, "betas": (0.8, 0.95)}),
        ("Adam", {"foreach": False, "eps": 1e-6}, FusedAdam, {"eps": 1e-6}),
        ("Adam", {"maximize": True}, torch.optim.AdamW, {"maximize": True, "fused": True}),
        ("Adam", {"foreach": True}, torch.optim.AdamW, {"foreach": True, "fused": None}),
        ("Adam", {"torch_adam": True}, torch.optim.AdamW, {"weight_decay": 0.01}),
        ("Adam", {"torch_adam": True, "adam_w_mode": False}, torch.optim.Adam, {"weight_decay": 0}),
        (
            "Adam",
            {"amsgrad": True, "fused": True, "set_grad_none": True},
            torch.optim.AdamW,
            {"amsgrad": True},
        ),
        ("Adam", {"bias_correction": False}, FusedAdam, {"bias_correction": False, "adam_w_mode": True}),
        (
            "Adam",
            {"bias_correction": False, "adam_w_mode": False, "weight_decay": 0.1},
            FusedAdam,
            {"adam_w_mode": False, "weight_decay": 0.1},
        ),
        (
            "SGD",
            {"lr": 0.1, "momentum": 0.9, "nesterov": True},
            torch.optim.SGD,
            {"momentum": 0.9, "nesterov": True},
        ),
        ("Adagrad", {"lr": 0.05}, torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-10}),
        ("RMSprop", {"alpha": 0.9}, torch.optim.RMSprop, {"alpha": 0.9, "lr": 0.01}),
        ("rmsprop", {}, torch.optim.RMSprop, {}),
        ("Adamax", {}, torch.optim.Adamax, {"lr": 0.002}),
        ("NAdam", {}, torch.optim.NAdam, {}),
        ("RAdam", {}, torch.optim.RAdam, {}),
        ("ASGD", {"t0": 10}, torch.optim.ASGD, {"t0": 10}),
        ("Rprop", {"etas": [0.4, 1.3]}, torch.optim.Rprop, {"etas": (0.4, 1.3)}),
        ("Adadelta", {}, torch.optim.Adadelta, {"lr": 1.0}),
        ("Lamb", {"max_coeff": 5.0}, Lamb, {"max_coeff": 5.0, "min_coeff": 0.01, "weight_decay": 0.0}),
        ("lion", {"betas": [0.9, 0.99]}, Lion, {"betas": (0.9, 0.99), "lr": 1e-3, "weight_decay": 0.0}),
    ],
)
def test_type_mapping(
    type_name: str, params: dict[str, Any], expected_cls: type, expected: dict[str, Any]
) -> None:
    opt = build_optimizer(type_name, params, _groups(3), stage=0)
    assert type(opt) is expected_cls
    if expected_cls is FusedAdam:  # DeepSpeed's CPU class where the optimizer is offloaded, as in DeepSpeed
        assert (
            type(build_optimizer(type_name, params, _groups(3), stage=1, offloaded=True)) is DeepSpeedCPUAdam
        )
    for key, value in expected.items():
        assert opt.defaults[key] == value, key
    if "betas" in opt.defaults:
        assert isinstance(opt.defaults["betas"], tuple)


def test_adamw_ignores_adam_w_mode_false_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zeroshard.optim_factory"):
        opt = build_optimizer("AdamW", {"adam_w_mode": False}, _groups(3), stage=2)
    assert type(opt) is FusedAdam and opt.defaults["decoupled_weight_decay"]
    assert "adam_w_mode=false is ignored" in caplog.text


def test_per_group_hyperparameters_override_config() -> None:
    groups: list[dict[str, Any]] = [
        {"params": [torch.zeros(2)]},
        {"params": [torch.zeros(2)], "lr": 0.5, "weight_decay": 0.0},
    ]
    opt = build_optimizer("AdamW", {"lr": 0.1, "weight_decay": 0.2}, groups, stage=1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("type_name", "params", "stage", "error", "fragments"),
    [
        ("Adamm", {}, 0, ValueError, ["optimizer.type", "'Adamm'", "did you mean 'Adam'", "AdamW", "SGD"]),
        ("Lamp", {}, 0, ValueError, ["did you mean 'Lamb'"]),
        (
            "Adam",
            {"weight_dacay": 0.1},
            0,
            ValueError,
            [
                "optimizer.params.weight_dacay",
                "AdamW",
                "did you mean 'weight_decay'",
                "Accepted keys",
                "betas",
            ],
        ),
        (
            "SGD",
            {"momentun": 0.9},
            0,
            ValueError,
            ["optimizer.params.momentun", "torch.optim.SGD", "'momentum'"],
        ),
        ("Lamb", {"min_coef": 0.1}, 0, ValueError, ["optimizer.params.min_coef", "Lamb", "'min_coeff'"]),
        ("LBFGS", {}, 0, ValueError, ["'LBFGS' is not available", "closure", "Available"]),
        ("SparseAdam", {}, 0, ValueError, ["'SparseAdam' is not available", "sparse"]),
        ("Adafactor", {}, 0, ValueError, ["'Adafactor' is not available", "1-D"]),
        ("OneBitAdam", {}, 0, ValueError, ["'OneBitAdam' is not available", "Available: Adam"]),
        ("ZeroOneAdam", {}, 0, ValueError, ["'ZeroOneAdam' is not available"]),
        ("OneBitLamb", {}, 0, ValueError, ["'OneBitLamb' is not available"]),
        ("Muon", {}, 0, ValueError, ["'Muon' is not available"]),
        ("MuAdamW", {}, 0, ValueError, ["'MuAdamW' is not available", "mup"]),
        ("Lamb", {}, 1, ValueError, ["whole-parameter norms", "stage 1", "stage 0", "AdamW"]),
        ("Lamb", {}, 3, ValueError, ["whole-parameter norms", "stage 3"]),
        (
            "Adam",
            {"max_grad_norm": 1.0},
            0,
            ValueError,
            ["optimizer.params.max_grad_norm", "gradient_clipping"],
        ),
        ("Adam", {"lr": "auto"}, 0, TypeError, ["optimizer.params.lr", "number", "'auto'"]),
        ("Adam", {"betas": [0.9]}, 0, TypeError, ["optimizer.params.betas", "2 values"]),
        ("Adam", {"betas": [0.9, "x"]}, 0, TypeError, ["optimizer.params.betas[1]"]),
        ("Adam", {"adam_w_mode": "yes"}, 0, TypeError, ["optimizer.params.adam_w_mode", "true or false"]),
        ("SGD", {"nesterov": 1}, 0, TypeError, ["optimizer.params.nesterov"]),
        ("SGD", {"lr": True}, 0, TypeError, ["optimizer.params.lr"]),
        ("SGD", {"lr": -1.0}, 0, ValueError, ["optimizer.params", "SGD", "Invalid learning rate"]),
        ("Adam", {"bias_correction": False, "amsgrad": True}, 0, ValueError, ["optimizer.params.amsgrad"]),
        (
            "Adam",
            {"bias_correction": False, "torch_adam": True},
            0,
            ValueError,
            ["bias_correction", "torch_adam"],
        ),
        ("Adam", {"bias_correction": False, "maximize": True}, 0, ValueError, ["optimizer.params.maximize"]),
        ("Lamb", {"amsgrad": True}, 0, ValueError, ["optimizer.params.amsgrad"]),
        ("Adam", {}, 4, ValueError, ["zero_optimization.stage", "4"]),
        (3, {}, 0, TypeError, ["optimizer.type"]),
    ],
)
def test_errors(
    type_name: Any, params: dict[str, Any], stage: int, error: type[Exception], fragments: list[str]
) -> None:
    with pytest.raises(error) as info:
        build_optimizer(type_name, params, _groups(3), stage=stage)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_lamb_is_allowed_at_stage_0() -> None:
    assert isinstance(build_optimizer("Lamb", {}, _groups(3), stage=0), Lamb)


# ---------------------------------------------------------------------------------------------
# Hand-written references for zeroshard's own optimizers


def _reference_ds_adam(
    p: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    bias_correction: bool,
    decoupled: bool,
) -> torch.Tensor:
    """DeepSpeed FusedAdam's update, one element-wise formula per line, one parameter."""
    p = p.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        if not decoupled:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        c1 = 1 - b1**t if bias_correction else 1.0
        c2 = 1 - b2**t if bias_correction else 1.0
        update = (m / c1) / ((v / c2).sqrt() + eps)
        if decoupled:
            update = update + wd * p
        p = p - lr * update
    return p


def _reference_lamb(
    p: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    wd: float,
    bias_correction: bool,
    min_coeff: float,
    max_coeff: float,
    eps_inside: bool,
) -> torch.Tensor:
    """DeepSpeed FusedLamb's update for one whole parameter."""
    p = p.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t) if bias_correction else m
        v_hat = v / (1 - b2**t) if bias_correction else v
        denom = (v_hat + eps).sqrt() if eps_inside else v_hat.sqrt() + eps
        update = m_hat / denom + wd * p
        w_norm = torch.linalg.vector_norm(p).item()
        u_norm = torch.linalg.vector_norm(update).item()
        coeff = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
        p = p - lr * coeff * update
    return p


def _reference_lion(
    p: torch.Tensor, grads: list[torch.Tensor], *, lr: float, betas: tuple[float, float], wd: float
) -> torch.Tensor:
    p = p.clone()
    m = torch.zeros_like(p)
    b1, b2 = betas
    for g in grads:
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    return p


def _run(opt_params: list[torch.Tensor], opt: torch.optim.Optimizer, grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(opt_params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()


def _random_run(
    sizes: tuple[int, ...], steps: int, seed: int = 0
) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(n, generator=gen) for n in sizes]
    grads = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(steps)]
    return init, grads


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_deepspeed_adam_matches_reference(decoupled: bool, bias_correction: bool) -> None:
    """zeroshard's foreach DeepSpeedAdam and the classes a config's "Adam" builds (DeepSpeed's FusedAdam and,
    offloaded, DeepSpeedCPUAdam: torch's fused kernel, or the foreach update without bias correction)."""
    init, grads = _random_run((7, 15), steps=5)
    config: dict[str, Any] = {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    config |= {"bias_correction": bias_correction, "adam_w_mode": decoupled}
    runs: list[tuple[type, Any]] = [
        (DeepSpeedAdam, lambda ps: DeepSpeedAdam(ps, **{**config, "betas": (0.8, 0.95)})),
        (FusedAdam, lambda ps: build_optimizer("Adam", config, [{"params": ps}], stage=2)),
        (
            DeepSpeedCPUAdam,
            lambda ps: build_optimizer("Adam", config, [{"params": ps}], stage=2, offloaded=True),
        ),
    ]
    for cls, make in runs:
        params = [t.clone() for t in init]
        opt = make(params)
        assert type(opt) is cls
        _run(params, opt, grads)
        for i, p in enumerate(params):
            expected = _reference_ds_adam(
                init[i], [g[i] for g in grads], lr=0.01, betas=(0.8, 0.95), eps=1e-6, wd=0.1,
                bias_correction=bias_correction, decoupled=decoupled,
            )  # fmt: skip
            torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7, msg=lambda m, c=cls: f"{c}: {m}")


def test_fused_adam_is_torch_fused_adam_bit_for_bit() -> None:
    """What the config's "Adam" builds gives exactly torch's fused AdamW / Adam, state included, and a
    state_dict either loads (checkpoints written with torch's class resume into DeepSpeed's and back)."""
    init, grads = _random_run((9, 33), steps=4, seed=3)
    for decoupled, torch_cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        ours, theirs = [t.clone() for t in init], [t.clone() for t in init]
        opt = FusedAdam(ours, lr=0.02, weight_decay=0.1, adam_w_mode=decoupled)
        ref = torch_cls(theirs, lr=0.02, weight_decay=0.1, fused=True)
        _run(ours, opt, grads[:2])
        _run(theirs, ref, grads[:2])
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))  # ours into torch's, then go on
        _run(ours, opt, grads[2:])
        _run(theirs, ref, grads[2:])
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), torch_cls
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[ours[1]][key], ref.state[theirs[1]][key]), key
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.zeros(2)], amsgrad=True)


def test_deepspeed_adam_with_bias_correction_tracks_torch_adamw() -> None:
    init, grads = _random_run((11,), steps=6)
    ours, theirs = [init[0].clone()], [init[0].clone()]
    _run(ours, DeepSpeedAdam(ours, lr=0.01, weight_decay=0.1), grads)
    _run(theirs, torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1), grads)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"max_coeff": 0.3},  # clamps the trust ratio down
        {"min_coeff": 3.0, "max_coeff": 10.0},  # clamps it up
        {"bias_correction": False, "weight_decay": 0.0},
        {"eps_inside_sqrt": True, "eps": 1e-3},
    ],
)
def test_lamb_matches_reference(overrides: dict[str, Any]) -> None:
    config: dict[str, Any] = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.01} | overrides
    init, grads = _random_run((7, 45, 4), steps=5)
    init[2] = torch.zeros(4)  # ||p|| == 0 on the first step: trust ratio 1
    params = [t.clone() for t in init]
    opt = build_optimizer("Lamb", config, [{"params": params}], stage=0)
    _run(params, opt, grads)
    for i, p in enumerate(params):
        expected = _reference_lamb(
            init[i], [g[i] for g in grads], lr=0.01, betas=(0.9, 0.99), eps=config["eps"],
            wd=config["weight_decay"], bias_correction=config.get("bias_correction", True),
            min_coeff=config.get("min_coeff", 0.01), max_coeff=config.get("max_coeff", 10.0),
            eps_inside=config.get("eps_inside_sqrt", False),
        )  # fmt: skip
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)


def test_lion_matches_reference() -> None:
    init, grads = _random_run((9, 4), steps=5)
    params = [t.clone() for t in init]
    opt = build_optimizer(
        "Lion", {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.1}, [{"params": params}], stage=1
    )
    _run(params, opt, grads)
    for i, p in enumerate(params):
        expected = _reference_lion(init[i], [g[i] for g in grads], lr=0.01, betas=(0.9, 0.99), wd=0.1)
        torch.testing.assert_close(p, expected, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Parameters without gradient are skipped

_EVERY_SUPPORTED = [
    ("Adam", {"weight_decay": 0.1}),
    ("Adam", {"adam_w_mode": False, "weight_decay": 0.1}),
    ("Adam", {"bias_correction": False, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    ("Adagrad", {"weight_decay": 0.1}),
    ("RMSprop", {"momentum": 0.9, "centered": True}),
    ("Adamax", {}),
    ("NAdam", {}),
    ("RAdam", {}),
    ("ASGD", {"weight_decay": 0.1}),
    ("Rprop", {}),
    ("Adadelta", {"weight_decay": 0.1}),
    ("Lamb", {"weight_decay": 0.1}),
    ("Lion", {"weight_decay": 0.1}),
]


@pytest.mark.parametrize(("type_name", "params"), _EVERY_SUPPORTED)
def test_params_without_grad_are_skipped(type_name: str, params: dict[str, Any]) -> None:
    frozen, trained = torch.randn(5), torch.randn(6)
    before = frozen.clone()
    opt = build_optimizer(type_name, params, [{"params": [frozen, trained]}], stage=0)
    state_before = copy.deepcopy(opt.state.get(frozen))
    for seed in range(3):
        _set_grads([trained], seed)
        opt.step()
    assert torch.equal(frozen, before)
    state_after = opt.state.get(frozen)
    if state_before is None:
        assert not state_after
    else:
        assert state_after is not None and state_before.keys() == state_after.keys()
        for key, value in state_before.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_after[key])), key
    assert not torch.equal(trained, torch.zeros(6))


# ---------------------------------------------------------------------------------------------
# The property the engine relies on: stepping 1-D slices of one flat buffer gives bitwise the
# same values as stepping the original shaped parameters.

_SHAPES = [(7,), (15, 3), (3, 5, 2), (4,), (257, 131), (1,)]  # (257, 131) crosses torch's CPU grain
_FROZEN = 3  # index of a parameter that never gets a gradient
_SOMETIMES = 0  # index of a parameter without gradient on step 1

_BITWISE_CASES = [
    *_EVERY_SUPPORTED,
    ("AdamW", {"amsgrad": True, "weight_decay": 0.01}),
    ("Adam", {"bias_correction": False, "adam_w_mode": False, "weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    ("Adam", {"torch_adam": True, "foreach": True}),
    ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "fused": True}),
    ("ASGD", {"t0": 1}),  # averaging starts at once
]


def _shaped_and_grads(steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(shape, generator=gen) for shape in _SHAPES]
    grads: list[list[torch.Tensor | None]] = []
    for step in range(steps):
        row: list[torch.Tensor | None] = [torch.randn(shape, generator=gen) for shape in _SHAPES]
        row[_FROZEN] = None
        if step == 1:
            row[_SOMETIMES] = None
        grads.append(row)
    return init, grads


def _flat_slices(world_size: int) -> list[list[tuple[int, int, int]]]:
    """Per rank, (param index, start, end) in the flat buffer; world_size 0 = whole parameters."""
    numels = [math.prod(shape) for shape in _SHAPES]
    offsets = [sum(numels[:i]) for i in range(len(numels) + 1)]
    if world_size == 0:
        return [[(i, offsets[i], offsets[i + 1]) for i in range(len(numels))]]
    shard = -(-offsets[-1] // world_size)  # padded shard size
    ranks = []
    for rank in range(world_size):
        low, high = rank * shard, (rank + 1) * shard
        ranks.append(
            [(i, max(low, offsets[i]), min(high, offsets[i + 1])) for i in range(len(numels))
             if max(low, offsets[i]) < min(high, offsets[i + 1])]
        )  # fmt: skip
    return ranks


@pytest.mark.parametrize(
    ("type_name", "params", "world_size"),
    [
        (type_name, params, world_size)
        for type_name, params in _BITWISE_CASES
        for world_size in ([0] if type_name == "Lamb" else [0, 2, 3])  # Lamb: whole parameters only
    ],
)
def test_flat_slices_step_bitwise_like_shaped_params(
    type_name: str, params: dict[str, Any], world_size: int
) -> None:
    """world_size 0: one view per whole parameter (stage 0); else each rank's padded shard."""
    steps = 4
    init, grads = _shaped_and_grads(steps)

    shaped = [t.clone() for t in init]
    reference = build_optimizer(type_name, params, [{"params": shaped}], stage=0)

    flat = torch.cat([t.reshape(-1) for t in init])
    flat_grad = torch.zeros_like(flat)
    ranks = []
    for pieces in _flat_slices(world_size):
        views = [flat[start:end] for _, start, end in pieces]
        ranks.append(
            (pieces, views, build_optimizer(type_name, params, [{"params": views}], stage=min(world_size, 1)))
        )

    for step_grads in grads:
        for p, g in zip(shaped, step_grads, strict=True):
            p.grad = None if g is None else g.clone()
        reference.step()
        flat_grad.copy_(
            torch.cat(
                [
                    (torch.zeros(s) if g is None else g).reshape(-1)
                    for s, g in zip(_SHAPES, step_grads, strict=True)
                ]
            )
        )
        for pieces, views, opt in ranks:
            for (index, start, end), view in zip(pieces, views, strict=True):
                view.grad = None if step_grads[index] is None else flat_grad[start:end].clone()
            opt.step()

    assert torch.equal(torch.cat([p.reshape(-1) for p in shaped]), flat)


def test_lamb_on_split_parameters_is_not_exact() -> None:
    """Why Lamb is refused at stages >= 1: per-slice norms change the trust ratio."""
    init, grads = _random_run((64,), steps=2)
    whole = [init[0].clone()]
    _run(whole, Lamb(whole, lr=0.1), [[g[0]] for g in grads])
    halves = [init[0][:32].clone(), init[0][32:].clone()]
    _run(halves, Lamb(halves, lr=0.1), [[g[0][:32], g[0][32:]] for g in grads])
    assert not torch.equal(torch.cat(halves), whole[0])


def test_deepspeed_adam_classes_step_groups_taken_from_another_optimizer_their_way() -> None:
    """accelerate, with the optimizer offloaded, builds DeepSpeedCPUAdam(adamw.param_groups, lr=...,
    weight_decay=..., adamw_mode=...): the groups keep their hyperparameters but are stepped by the fused
    kernel in the class's weight-decay mode, as DeepSpeed's kernel steps them; AMSGrad is refused."""
    init, grads = _random_run((5, 9, 4), steps=4, seed=7)
    for client_cls, adamw_mode, torch_cls in (
        (torch.optim.AdamW, True, torch.optim.AdamW),
        (torch.optim.Adam, False, torch.optim.Adam),
    ):
        ours, theirs = [t.clone() for t in init], [t.clone() for t in init]
        groups = [{"params": ours[:2]}, {"params": ours[2:], "weight_decay": 0.0, "lr": 0.05}]
        client = client_cls(groups, lr=0.01, weight_decay=0.1, foreach=True)
        opt = DeepSpeedCPUAdam(client.param_groups, lr=0.01, weight_decay=0.1, adamw_mode=adamw_mode)
        assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        ref_groups = [{"params": theirs[:2]}, {"params": theirs[2:], "weight_decay": 0.0, "lr": 0.05}]
        ref = torch_cls(ref_groups, lr=0.01, weight_decay=0.1, fused=True)
        _run(ours, opt, grads)
        _run(theirs, ref, grads)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), client_cls
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DeepSpeedCPUAdam(torch.optim.AdamW([torch.zeros(2)], amsgrad=True).param_groups)
