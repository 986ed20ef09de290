"""Stage 2 keeps only this rank's gradient shard between reductions (#18 item 1).

Model-state bytes are deterministic: they are read from the engine's own accounting
(``memory_breakdown()``) and, independently, by summing the distinct storages of the tensors the engine
holds, and compared with the ZeRO formula 4N + 12N/W (fp32 Adam) plus the bucket allowance: the transient
gradient buckets, bounded by ``reduce_bucket_size`` (and ``MAX_UNIT_ELEMENTS``) times the buckets in
flight, not by the model size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from zeroshard.core.inflight import MAX_INFLIGHT
from zeroshard.core.units import MAX_UNIT_ELEMENTS

BUCKET = 20_000  # elements: about one hidden layer per unit, a small fraction of the model


def _mlp(width: int = 127, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(33, width), nn.Tanh()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 5))
    return nn.Sequential(*layers)


def _held_bytes(engine: Any) -> int:
    """Distinct storages of every tensor the engine keeps between steps: the units' buffers and the
    optimizer's state (the gradient buckets are transient and counted separately; a stage-2 gradient shard
    exists only from its reduction to the step's zero_grad: flat_param.py [Note: gradient shards on
    demand])."""
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = []
    for unit in engine.units:
        tensors += [unit.full, unit.master]
        if unit.holds_grad_shard:
            tensors.append(unit.grad_shard)
        if unit.grad_full is not None:
            tensors.append(unit.grad_full)
    for state in engine.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _run(
    rank: int, world_size: int, stage: int, gas: int, zero: dict[str, Any], width: int
) -> dict[str, Any]:
    model = _mlp(width) if width else _mlp()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, **zero},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(rank)
    in_features = model[0].in_features
    during: list[Any] = []
    shards: list[tuple[bool, bool]] = []  # every unit holds a gradient shard: after forward, after backward
    for _ in range(2):  # two optimizer steps: the optimizer state exists from the first on
        for _ in range(gas):
            loss = engine(torch.randn(4, in_features)).pow(2).mean()
            held = all(u.holds_grad_shard for u in engine.units)
            engine.backward(loss)
            shards.append((held, all(u.holds_grad_shard for u in engine.units)))
            during.append(engine.memory_breakdown())  # gradients held between backward and step
            engine.step()
    return {
        "shards": shards,
        "during": during,
        "after": engine.memory_breakdown(),
        "held": _held_bytes(engine),
        "unit_sizes": [u.layout.padded for u in engine.units],
        "slices": len(engine.sharded_step.slices),
        "idle": engine.reducer.pool.idle_bytes,
    }


def _sweep(rank: int, world_size: int) -> list[dict[str, Any]]:
    out = []
    for gas in (1, 2):
        for stage in (1, 2):
            out.append(_run(rank, world_size, stage, gas, {"reduce_bucket_size": BUCKET}, 0))
    out.append(_run(rank, world_size, 2, 2, {"reduce_bucket_size": BUCKET, "overlap_comm": True}, 0))
    return out


def _check_formula_within_the_bucket_allowance(per_rank: list[Any], world_size: int) -> None:
    n = sum(p.numel() for p in _mlp().parameters())
    w = world_size
    for rank, results in enumerate(per_rank):
        stage1 = {1: results[0], 2: results[2]}
        for k, r in enumerate(results):
            stage = 1 if k in (0, 2) else 2
            largest = 4 * max(r["unit_sizes"])
            assert max(r["unit_sizes"]) <= BUCKET + w
            # Padding (< W elements per unit, 4 bytes each, in params, grads, Adam's two states) and a
            # 4-byte step counter per optimizer slice.
            slack = 16 * w * len(r["unit_sizes"]) + 4 * r["slices"]
            formula = {1: 8 * n + 8 * n // w, 2: 4 * n + 12 * n // w}[stage]
            gas = 2 if k in (2, 3, 4) else 1
            for i, mb in enumerate([*r["during"], r["after"]]):
                assert mb.predicted.total == pytest.approx(formula, abs=16)
                kept = mb.parameters + mb.gradients + mb.optimizer_state
                if i >= gas:  # before the first step Adam has no state yet
                    assert abs(kept - formula) <= slack, (rank, k, kept, formula)
                if stage == 2:
                    # Only this rank's shard of the gradient between reductions, at every micro-step.
                    assert abs(mb.gradients - 4 * n // w) <= 4 * w * len(r["unit_sizes"])
                    # The bucket allowance: unit-sized buckets, at most those filling plus those in flight.
                    assert largest <= mb.communication_buffers <= (MAX_INFLIGHT + 1) * largest
                    assert mb.communication_buffers < 4 * n // 2  # bounded by the bucket, not the model
                else:
                    assert mb.communication_buffers == 0 and mb.gradients >= 4 * n
            # The tensors themselves, counted independently of memory_breakdown(), which counts stage 2's
            # gradient shards at their size (they exist from the first reduction to the step's zero_grad).
            after = r["after"]
            shards = 4 * sum(u // w for u in r["unit_sizes"]) if stage == 2 else 0
            assert r["held"] + shards == after.parameters + after.gradients + after.optimizer_state
            # Stage 2 holds gradient shards only from the backward to the step; stage 1 its full gradients.
            held = [(stage == 1 or i % gas != 0, True) for i in range(2 * gas)]
            assert r["shards"] == held, (stage, gas, r["shards"])
            assert abs(r["held"] + shards - formula) <= slack
            # Idle pooled buffers are bounded like the buckets (buffers.py [Note: buffer reuse]).
            assert r["idle"] <= (MAX_INFLIGHT + 3) * largest
        # Stage 2 saves (W-1)/W of the gradient over stage 1, with GAS 1 and 2.
        for gas, k in ((1, 1), (2, 3)):
            saved = stage1[gas]["after"].total - results[k]["after"].total
            assert saved >= 4 * n * (w - 1) // w - (MAX_INFLIGHT + 1) * 4 * max(results[k]["unit_sizes"])


def _default_buckets(rank: int, world_size: int) -> dict[str, Any]:
    return _run(rank, world_size, 2, 1, {}, 1024)


def _check_units_bounded_with_the_default_reduce_bucket_size(per_rank: list[Any]) -> None:
    """DeepSpeed's default ``reduce_bucket_size`` (5e8) exceeds most models: units stay bounded anyway."""
    n = sum(p.numel() for p in _mlp(1024).parameters())
    assert n > 2 * MAX_UNIT_ELEMENTS
    for r in per_rank:
        assert len(r["unit_sizes"]) >= 3 and max(r["unit_sizes"]) <= MAX_UNIT_ELEMENTS + 2
        mb = r["after"]
        assert mb.communication_buffers <= (MAX_INFLIGHT + 1) * 4 * MAX_UNIT_ELEMENTS
        assert abs(mb.gradients - 4 * n // 2) <= 8 * len(r["unit_sizes"])
        # Between steps the gradient shards are dropped ([Note: gradient shards on demand]).
        assert (
            abs(r["held"] + mb.gradients - (4 * n + 12 * n // 2))
            <= 32 * len(r["unit_sizes"]) + 4 * r["slices"]
        )


def _full_grads(rank: int, world_size: int) -> list[str]:
    """safe_get_full_grad against gradients computed in one process on every rank's batches."""
    from zeroshard.deepspeed.utils import safe_get_full_grad

    failures = []
    for stage in (0, 1, 2, 3):
        for gas in (1, 2):
            model = _mlp(width=31, depth=2)
            reference = _mlp(width=31, depth=2)
            config = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": gas,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
            }
            engine, _, _, _ = zeroshard.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )

            def data(r: int, micro: int) -> torch.Tensor:
                return torch.randn(4, 33, generator=torch.Generator().manual_seed(100 * r + micro))

            for micro in range(gas):
                engine.backward(engine(data(rank, micro)).pow(2).mean())
                # Reduced over ranks: every backward at stages 2-3, at the boundary at stages 0-1.
                reduced = stage >= 2 or micro == gas - 1
                reference.zero_grad()
                for m in range(micro + 1):
                    for r in range(world_size) if reduced else [rank]:
                        scale = gas * (world_size if reduced else 1)
                        (reference(data(r, m)).pow(2).mean() / scale).backward()
                for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                    got = safe_get_full_grad(p)
                    assert got is not None and got.shape == p.shape
                    if not torch.allclose(got, q.grad, rtol=1e-5, atol=1e-7):
                        failures.append(f"stage {stage} gas {gas} micro {micro} {name}")
                engine.step()
            engine.destroy()
    return failures


def _check_safe_get_full_grad(per_rank: list[Any]) -> None:
    """Where only a shard is held (stages 2-3, and 1 after the boundary) the full gradient is gathered on
    demand; it equals the gradient of the same micro-batches in one process."""
    for failures in per_rank:
        assert failures == []


def _control_calls(rank: int, world_size: int) -> list[tuple[int, str, int, int]]:
    out = []
    for stage in (0, 1, 2):
        for precision in ("fp32", "fp16", "bf16"):
            model = _mlp(width=31, depth=2)
            config: dict[str, Any] = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_clipping": 0.5,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
            }
            if precision == "fp16":
                config["fp16"] = {"enabled": True, "auto_cast": True}
            if precision == "bf16":
                config["bf16"] = {"enabled": True, "check_grad_overflow": True}
            engine, _, _, _ = zeroshard.initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
            dtype = next(model.parameters()).dtype
            for _ in range(2):
                engine.comm.stats.reset()
                loss = engine(torch.randn(4, 33, dtype=dtype)).float().pow(2).mean()
                engine.backward(loss)
                engine.step()
            out.append((stage, precision, engine.comm.stats.control_calls, engine.global_steps))
    return out


def _check_one_control_collective(rank0: list[tuple[int, str, int, int]]) -> None:
    """The overflow flag, the gradient norm and which parameters got a gradient anywhere travel in one
    all-reduce: a step at stages 0-2 launches exactly one control collective besides the model state's."""
    for stage, precision, calls, steps in rank0:
        assert calls == 1, (stage, precision, calls)
        assert steps == 2


class _Tied(nn.Module):
    """A one-parameter unit without padding (the 64 x 64 table, tied to the head, as a GPT's embedding) among
    small padded ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(64, 64)
        self.mid = nn.Linear(64, 7)
        self.out = nn.Linear(7, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.table(idx)))
        return (self.out(h) @ self.table.weight.t()).logsumexp(-1).mean()


def _adopted_vs_copied(rank: int, world_size: int) -> list[tuple[int, int, list[list[float]]]]:
    from zeroshard.core.grad_sync import GradientReducer

    out = []
    for stage in (2, 3):
        for adopt in (True, False):
            model = _Tied()
            zero = {"stage": stage, "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0}
            config = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_optimization": zero,
            }
            engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
            adopted = [0]
            real = engine.reducer._buckets._adopt

            def spy(*args: Any, real: Any = real, adopt: bool = adopt, adopted: list[int] = adopted) -> bool:
                took = adopt and real(*args)
                adopted[0] += took
                return took

            engine.reducer._buckets._adopt = spy  # type: ignore[method-assign]
            assert isinstance(engine.reducer, GradientReducer)
            g = torch.Generator().manual_seed(rank)
            for _ in range(4):  # micro-steps: two optimizer steps
                loss = engine(torch.randint(64, (4, 5), generator=g))
                engine.backward(loss)
                engine.step()
            out.append((stage, adopted[0], [u.master.tolist() for u in engine.units]))  # plain: to the parent
    return out


def _check_adopted_gradients_train_as_copied(
    per_rank: list[list[tuple[int, int, list[list[float]]]]],
) -> None:
    """The embedding-like unit's gradient is reduce-scattered as autograd produced it (no bucket beside it),
    and training is bitwise the same as with the copy into a bucket, at stages 2 and 3 with GAS 2."""
    for rank, results in enumerate(per_rank):
        for k in (0, 2):
            (stage, took, masters), (_, none, copied) = results[k], results[k + 1]
            assert took == 4 and none == 0, (rank, stage, took, none)  # every backward: 4 micro-steps
            assert masters == copied, (rank, stage)


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn per world size: the formula sweep; at W=2 also the default buckets, safe_get_full_grad
    the control-collective count and the adopted
    gradient of a one-parameter unit."""
    out: dict[str, Any] = {"sweep": _sweep(rank, world_size)}
    if world_size == 2:
        out["default"] = _default_buckets(rank, world_size)
        out["full_grads"] = _full_grads(rank, world_size)
        out["control"] = _control_calls(rank, world_size)
        out["adopted"] = _adopted_vs_copied(rank, world_size)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage2_memory_full_gradients_and_control_collectives(world_size: int) -> None:
    per_rank = run_distributed(_worker, world_size)
    _check_formula_within_the_bucket_allowance([r["sweep"] for r in per_rank], world_size)
    if world_size == 2:
        _check_units_bounded_with_the_default_reduce_bucket_size([r["default"] for r in per_rank])
        _check_safe_get_full_grad([r["full_grads"] for r in per_rank])
        _check_one_control_collective(per_rank[0]["control"])
        _check_adopted_gradients_train_as_copied([r["adopted"] for r in per_rank])
