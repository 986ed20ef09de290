"""Engine features checked against one-process training at W = 2, every stage, one spawn for all sub-cases:
``prescale_gradients`` / ``gradient_predivide_factor``, ``backward(scale_wrt_gas=False)``,
``backward(retain_graph=True)`` twice per micro-step, ``step(lr_kwargs=...)``, ``set_z3_leaf_modules`` with
rank-dependent routing, ``save_checkpoint(exclude_frozen_parameters=True)`` then load, and
``communication_bytes()`` against the ZeRO paper's volume (2Ψ at stages 0-2, 3Ψ at stage 3) in the
communication dtype.

The reference is one process holding the whole model: it runs each rank's micro-batch in turn and averages
their losses, so its gradient is the average the ranks' reduction computes. SGD with momentum is linear in
the gradient: a gradient off by a constant factor (a predivide not undone, a loss scaled twice) shows in the
parameters, where Adam's normalisation would hide it. Tolerance as in test_engine_api: fp32 reordering of
the same sums, 1e-6 of the largest value.
"""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
import zeroshard.deepspeed.utils
from tests.distributed import run_distributed
from tests.models import batch, make_model
from zeroshard.checkpoint import CheckpointError

STEPS = 3


def _config(stage: int, gas: int = 1, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # every parameter sharded and gathered on use, none kept full
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        **extra,
    }


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _assert_same(engine: Any, model: nn.Module, ref: nn.Module, what: str) -> None:
    with engine.gathered_parameters():  # stage 3: parameters are placeholders between uses
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            err = float((p.detach() - q.detach()).abs().max())
            assert err <= 1e-6 * float(q.detach().abs().max()) + 1e-7, f"{what} {name}: {err}"


def _reference_backward(
    ref: nn.Module, step: int, micro: int, world_size: int, divide: float = 1.0, square: bool = False
) -> None:
    """The one-process gradient of the ranks' average of ``loss / divide`` (``(loss + loss**2) / divide``
    with ``square``)."""
    losses = [ref(*batch(step, micro, r)) for r in range(world_size)]
    if square:
        losses = [loss + loss * loss for loss in losses]
    (sum(losses) / (world_size * divide)).backward()


# -- sub-cases ---------------------------------------------------------------------------------------
def prescale_cases(rank: int, world_size: int) -> None:
    """Dividing before the reduction by the predivide factor and after it by W / factor is still the
    average; without ``prescale_gradients`` the factor has no effect (DeepSpeed's ZeRO stages)."""
    for stage in (0, 1, 2, 3):
        for prescale, factor in ((True, 1.0), (True, 2.0), (True, 8.0), (False, 4.0)):
            gas = 2
            model, what = make_model(0), f"stage {stage} prescale {prescale} predivide {factor}"
            ref = copy.deepcopy(model)
            ref_opt = _sgd(_trainable(ref))
            config = _config(stage, gas, prescale_gradients=prescale, gradient_predivide_factor=factor)
            engine, *_ = zeroshard.initialize(model=model, optimizer=_sgd(_trainable(model)), config=config)
            for step in range(STEPS):
                for micro in range(gas):
                    engine.backward(engine(*batch(step, micro, rank)))
                    engine.step()
                    _reference_backward(ref, step, micro, world_size, divide=gas)
                ref_opt.step()
                ref_opt.zero_grad()
                _assert_same(engine, model, ref, f"{what} step {step}")


def scale_wrt_gas_cases(rank: int, world_size: int) -> None:
    """``backward(loss, scale_wrt_gas=False)``: the micro-batch losses are summed, not averaged."""
    for stage in (0, 1, 2, 3):
        for scale in (True, False):
            gas = 3
            model = make_model(0)
            ref = copy.deepcopy(model)
            ref_opt = _sgd(_trainable(ref))
            engine, *_ = zeroshard.initialize(
                model=model, optimizer=_sgd(_trainable(model)), config=_config(stage, gas)
            )
            for step in range(STEPS):
                for micro in range(gas):
                    engine.backward(engine(*batch(step, micro, rank)), scale_wrt_gas=scale)
                    engine.step()
                    _reference_backward(ref, step, micro, world_size, divide=gas if scale else 1)
                ref_opt.step()
                ref_opt.zero_grad()
                _assert_same(engine, model, ref, f"stage {stage} scale_wrt_gas {scale} step {step}")


def retain_graph_cases(rank: int, world_size: int) -> None:
    """Two backwards through one forward's graph before the step: the gradients of both losses add up (at
    stage 3 each backward gathers the parameters again)."""
    for stage in (0, 1, 2, 3):
        for gas in (1, 2):
            model = make_model(0)
            ref = copy.deepcopy(model)
            ref_opt = _sgd(_trainable(ref))
            engine, *_ = zeroshard.initialize(
                model=model, optimizer=_sgd(_trainable(model)), config=_config(stage, gas)
            )
            for step in range(STEPS):
                for micro in range(gas):
                    loss = engine(*batch(step, micro, rank))
                    engine.backward(loss, retain_graph=True)
                    engine.backward(loss * loss)  # the same graph again, a different function of it
                    engine.step()
                    _reference_backward(ref, step, micro, world_size, divide=gas, square=True)
                ref_opt.step()
                ref_opt.zero_grad()
                _assert_same(engine, model, ref, f"stage {stage} gas {gas} retain_graph step {step}")


def lr_kwargs_cases(rank: int, world_size: int) -> None:
    """``step(lr_kwargs=...)`` reaches the scheduler's ``step``: ReduceLROnPlateau's metric, and the config
    scheduler WarmupLR's ``last_batch_iteration`` (a jump ahead in the warm-up)."""
    for stage in (0, 2, 3):
        model = make_model(0)
        ref = copy.deepcopy(model)
        ref_opt = _sgd(_trainable(ref))
        ref_sched = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=0)
        opt = _sgd(_trainable(model))
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        engine, _, _, zsched = zeroshard.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=_config(stage)
        )
        assert zsched is sched
        for step in range(STEPS + 1):
            engine.backward(engine(*batch(step, 0, rank)))
            metric = 1.0  # never improves: each step after the first halves the rate
            engine.step(lr_kwargs={"metrics": metric})
            _reference_backward(ref, step, 0, world_size)
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step(metric)
            assert engine.get_lr() == pytest.approx([g["lr"] for g in ref_opt.param_groups])
            _assert_same(engine, model, ref, f"stage {stage} ReduceLROnPlateau step {step}")
        assert engine.get_lr() == pytest.approx([0.05 * 0.5**STEPS])
    for stage in (1, 3):
        model = make_model(0)
        params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}
        config = _config(
            stage,
            optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            scheduler={"type": "WarmupLR", "params": params},
        )
        engine, *_ = zeroshard.initialize(model=model, model_parameters=_trainable(model), config=config)
        ref = copy.deepcopy(make_model(0))
        ref_opt = _sgd(_trainable(ref))
        lrs = []
        for step, jump in enumerate((None, 5, None, 8)):
            lr = engine.get_lr()[0]  # the rate this step applies
            lrs.append(lr)
            engine.backward(engine(*batch(step, 0, rank)))
            engine.step(lr_kwargs=None if jump is None else {"last_batch_iteration": jump})
            for group in ref_opt.param_groups:
                group["lr"] = lr
            _reference_backward(ref, step, 0, world_size)
            ref_opt.step()
            ref_opt.zero_grad()
            _assert_same(engine, model, ref, f"stage {stage} WarmupLR step {step}")
        # Linear warm-up to 0.1 over 10 iterations, lr(k) = 0.01 k, applied at iterations -1 (construction),
        # 0, then 5 (set by lr_kwargs), 6; the last step sets 8.
        assert lrs == pytest.approx([0.0, 0.0, 0.05, 0.06]), lrs
        assert engine.get_lr() == pytest.approx([0.08])


class Experts(nn.Module):
    """A mixture of experts whose routing depends on the data: ranks run different experts."""

    def __init__(self, width: int = 6, n: int = 3) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(n))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        choice = int(h.detach().sum().abs() * 1000) % len(self.experts)
        self.last_choice = choice
        return h + self.experts[choice](h)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.moe = Experts()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.moe(self.inp(x)))).pow(2).mean()


def leaf_cases(rank: int, world_size: int) -> list[list[int]]:
    """Stage 3 with the experts block a leaf: one unit, gathered whole, so ranks may route differently;
    through the top-level name, through ``deepspeed.utils``'s, and through the config's
    ``zero_optimization.leaf_module`` (which marks the module, as DeepSpeed's engine does)."""
    routes = []
    qualified = f"{Experts.__module__}.{Experts.__qualname__}"
    marks = (zeroshard.set_z3_leaf_modules, zeroshard.deepspeed.utils.set_z3_leaf_modules, None)
    for mark in marks:
        torch.manual_seed(0)
        model = Routed()
        ref = copy.deepcopy(model)
        ref_opt = _sgd(ref.parameters())
        config = _config(3)
        if mark is None:
            config["zero_optimization"]["leaf_module"] = {"classes": [qualified]}
        else:
            mark(model, [Experts])
        engine, *_ = zeroshard.initialize(model=model, optimizer=_sgd(model.parameters()), config=config)
        if mark is None:
            assert zeroshard.deepspeed.utils.z3_leaf_module(model.moe)
            assert not zeroshard.deepspeed.utils.z3_leaf_module(model)
        units = [
            sorted(n for n, p in model.named_parameters() if any(p is q for q in u.params))
            for u in engine.units
        ]
        assert sorted(n for n, _ in model.moe.named_parameters(prefix="moe")) in units, units
        chosen = []
        for step in range(STEPS + 1):
            xs = [torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
            engine.backward(engine(xs[rank]))
            chosen.append(model.moe.last_choice)
            engine.step()
            (sum(ref(x) for x in xs) / world_size).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            _assert_same(engine, model, ref, f"leaf {getattr(mark, '__module__', 'config')} step {step}")
        routes.append(chosen)
    return routes


def exclude_frozen_cases(rank: int, world_size: int) -> None:
    """``exclude_frozen_parameters=True`` leaves the frozen parameter out of the checkpoint: a strict load
    names it as missing; a non-strict load restores the rest and keeps the live frozen values; with the
    frozen values the first run had, training then goes on exactly as without the save."""
    for stage in (1, 3):
        with tempfile.TemporaryDirectory() as tmp:
            save_dir = [tmp if rank == 0 else ""]
            torch.distributed.broadcast_object_list(save_dir, src=0)
            model = make_model(0)
            engine, *_ = zeroshard.initialize(
                model=model, optimizer=_sgd(_trainable(model)), config=_config(stage)
            )
            for step in range(2):
                engine.backward(engine(*batch(step, 0, rank)))
                engine.step()
            engine.save_checkpoint(save_dir[0], tag="t", exclude_frozen_parameters=True)
            saved = engine.full_state_dict()
            for step in range(2, 4):  # the uninterrupted run
                engine.backward(engine(*batch(step, 0, rank)))
                engine.step()
            expected = engine.full_state_dict()

            other = make_model(1)  # other values everywhere, the frozen layer included
            own_frozen = {f"frozen.{k}": v.clone() for k, v in other.frozen.state_dict().items()}
            fresh, *_ = zeroshard.initialize(
                model=other, optimizer=_sgd(_trainable(other)), config=_config(stage)
            )
            with pytest.raises(CheckpointError, match=r"missing keys \[.*'frozen\.weight'"):
                fresh.load_checkpoint(save_dir[0], tag="t")
            path, _ = fresh.load_checkpoint(save_dir[0], tag="t", load_module_strict=False)
            assert path is not None
            got = fresh.full_state_dict()
            for k, v in saved.items():
                want = own_frozen.get(k, v)  # frozen: the live value; the rest: the saved one
                assert torch.equal(got[k], want), f"stage {stage}: {k} after a load without frozen parameters"

            resumed = make_model(1)
            resumed.frozen.load_state_dict(make_model(0).frozen.state_dict())
            again, *_ = zeroshard.initialize(
                model=resumed, optimizer=_sgd(_trainable(resumed)), config=_config(stage)
            )
            again.load_checkpoint(save_dir[0], tag="t", load_module_strict=False)
            for step in range(2, 4):
                again.backward(again(*batch(step, 0, rank)))
                again.step()
            got = again.full_state_dict()
            for k, v in expected.items():
                assert torch.equal(got[k], v), f"stage {stage}: {k} differs after the resumed steps"
            torch.distributed.barrier()  # rank 0 removes the directory


def comm_bytes_cases(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """``communication_bytes()`` over one step, by stage and dtype, with the padded element count."""
    out = {}
    torch.manual_seed(0)
    for stage in (0, 1, 2, 3):
        for dtype, comm in (("fp32", None), ("bf16", None), ("bf16", "fp32")):
            model = nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))
            extra: dict[str, Any] = {"bf16": {"enabled": dtype == "bf16"}}
            if comm is not None:
                extra["communication_data_type"] = comm
            config = _config(stage, optimizer={"type": "SGD", "params": {"lr": 0.01}}, **extra)
            # Gathered again for backward, nothing kept for the next step: the paper's 3Ψ (less the first
            # layer's backward gather).
            config["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
            engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
            x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
            cast = torch.bfloat16 if dtype == "bf16" else torch.float32
            for _ in range(2):  # the first step records stage 3's gather order
                before = engine.communication_bytes()
                engine.backward(engine(x.to(cast)).float().pow(2).mean())
                engine.step()
                moved = engine.communication_bytes() - before
            out[f"{stage} {dtype} {comm}"] = {
                "moved": moved,
                "padded": sum(u.layout.padded for u in engine.units),
                "first": engine.units[0].layout.padded,
                "by_op": dict(engine.comm.stats.bytes_by_op),
            }
    return out


def features_worker(rank: int, world_size: int) -> dict[str, Any]:
    prescale_cases(rank, world_size)
    scale_wrt_gas_cases(rank, world_size)
    retain_graph_cases(rank, world_size)
    lr_kwargs_cases(rank, world_size)
    exclude_frozen_cases(rank, world_size)
    return {"leaf": leaf_cases(rank, world_size), "bytes": comm_bytes_cases(rank, world_size)}


@pytest.mark.timeout(300)
def test_engine_features_match_one_process() -> None:
    results = run_distributed(features_worker, 2)
    for key, r in results[0]["bytes"].items():
        stage, dtype, comm = key.split()
        gather = 2 if dtype == "bf16" else 4  # parameters travel in the compute dtype
        reduce = 4 if comm == "fp32" or dtype == "fp32" else 2  # gradients in communication_data_type
        psi_gather, psi_reduce = gather * r["padded"], reduce * r["padded"]
        expected = {
            "0": 2 * psi_reduce,  # all-reduce: reduce-scatter + all-gather of the gradients
            "1": psi_reduce + psi_gather,
            "2": psi_reduce + psi_gather,
            # Forward and backward gathers, but none for the first layer's backward, which reads its input,
            # not its weight (stage3/spent_units.py [Note: spent units]).
            "3": psi_reduce + 2 * psi_gather - gather * r["first"],
        }[stage]
        assert r["moved"] == expected, (key, r)
    assert results[1]["bytes"] == results[0]["bytes"]
    # The point of a leaf: at some step the ranks ran different experts (and still matched one process).
    for r0, r1 in zip(results[0]["leaf"], results[1]["leaf"], strict=True):
        assert r0 != r1, (r0, r1)


def test_deepspeed_schedule_step_takes_last_batch_iteration() -> None:
    """DeepSpeed's schedules take ``step(last_batch_iteration=k)``: the lr of iteration k, then k + 1, ...;
    a value that is not an integer >= -1 is an error naming it."""
    from zeroshard.lr_schedules import build_scheduler

    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}
    sched = build_scheduler("WarmupLR", params, opt)
    opt.step()  # torch warns about a scheduler stepped before its optimizer
    sched.step(last_batch_iteration=7)
    assert sched.last_batch_iteration == 7 and opt.param_groups[0]["lr"] == pytest.approx(0.07)
    sched.step()
    assert sched.last_batch_iteration == 8 and opt.param_groups[0]["lr"] == pytest.approx(0.08)
    with pytest.raises(ValueError, match=r"step\(last_batch_iteration\): expected an integer >= -1, got -2"):
        sched.step(last_batch_iteration=-2)
    with pytest.raises(TypeError, match=r"step\(last_batch_iteration\): expected an integer, got 1.5"):
        sched.step(last_batch_iteration=1.5)  # type: ignore[arg-type]
