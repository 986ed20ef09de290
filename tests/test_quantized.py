"""ZeRO++'s quantized collectives (``zero_quantized_weights``, ``zero_quantized_gradients``; core/quantize.py
[Note: quantized collectives]).

The format's error bound and its non-finite values; at W=4 the two collectives against a reference computed
from every rank's input, their bytes, and training at stage 3: lossy (close to, never equal to, the
unquantized run), the same parameters on every rank, inside MiCS's shard groups too, hpZ on top
bit-identical to qwZ alone, and fp16 overflow still detected through int8 gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.test_hpz import Blocks
from zeroshard.config import ConfigWarning, load_config
from zeroshard.core.comm import Comm
from zeroshard.core.quantize import (
    BLOCK,
    dequantize,
    packed_bytes,
    quantize,
    quantized_all_gather,
    quantized_reduce_scatter,
)

pytestmark = pytest.mark.timeout(600)

WORLD = 4


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x), x.numel(), torch.empty(x.numel()))


def test_format_error_bound_and_special_values() -> None:
    torch.manual_seed(0)
    for n in (1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 7):
        x = torch.randn(n) * torch.logspace(-3, 3, n)
        packet = quantize(x)
        assert packet.dtype == torch.uint8 and packet.numel() == packed_bytes(n) == -(-n // BLOCK) * (
            BLOCK + 4
        )
        back = _round_trip(x)
        for start in range(0, n, BLOCK):
            block = x[start : start + BLOCK]
            half_step = float(block.abs().max()) / 127 / 2
            assert float((back[start : start + BLOCK] - block).abs().max()) <= half_step * (1 + 1e-5)
    assert torch.equal(_round_trip(torch.zeros(300)), torch.zeros(300))
    assert torch.equal(_round_trip(torch.full((3,), 127.0)), torch.full((3,), 127.0))
    # A NaN or an infinity makes its whole block non-finite (the overflow check sees it); others survive.
    x = torch.randn(3 * BLOCK)
    x[5], x[BLOCK + 9] = float("nan"), float("inf")
    back = _round_trip(x)
    assert not back[:BLOCK].isfinite().any() and not back[BLOCK : 2 * BLOCK].isfinite().any()
    assert back[2 * BLOCK :].isfinite().all()
    # Rows pack independently: a 2-D input is one packet per row.
    rows = torch.randn(3, 300, dtype=torch.bfloat16)
    assert quantize(rows).shape == (3, packed_bytes(300))
    assert torch.equal(quantize(rows)[1], quantize(rows[1]))


def test_keys_warn_below_stage_3() -> None:
    base = {"train_micro_batch_size_per_gpu": 1}
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        with pytest.warns(ConfigWarning, match=f"{key}: true has no effect at stage 2"):
            load_config({**base, "zero_optimization": {"stage": 2, key: True}}, world_size=2)
        loaded = load_config({**base, "zero_optimization": {"stage": 3, key: True}}, world_size=2)
        assert not [w for w in loaded.warnings if key in w], loaded.warnings


# -- the collectives at W=4 ----------------------------------------------------------------------------------
def _input(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def _collectives(rank: int, world: int) -> list[str]:
    problems = []
    comm = Comm()
    n = 3 * BLOCK + 11  # a partial last block
    full = torch.empty(world * n)
    quantized_all_gather(comm, full, _input(rank, n), what="test gather").wait()
    want = torch.cat([_round_trip(_input(r, n)) for r in range(world)])
    if not torch.equal(full, want):
        problems.append(f"all-gather: {float((full - want).abs().max())}")
    gathered = comm.stats.bytes_by_op["all_gather"]
    if gathered != world * packed_bytes(n):
        problems.append(f"all-gather counted {gathered} bytes, expected {world * packed_bytes(n)}")
    out = torch.empty(n)
    quantized_reduce_scatter(comm, out, _input(rank, world * n), what="test reduce-scatter").wait()
    chunks = [_input(r, world * n)[rank * n : (rank + 1) * n] for r in range(world)]
    expect = torch.zeros(n)
    for r, chunk in enumerate(chunks):  # rank order; this rank's own chunk exact
        expect += chunk if r == rank else _round_trip(chunk)
    if not torch.equal(out, expect):
        problems.append(f"reduce-scatter: {float((out - expect).abs().max())}")
    exact = torch.stack(chunks).sum(0)
    if not 0 < float((out - exact).abs().max()) <= 4 * float(exact.abs().max()) / 127:
        problems.append("reduce-scatter: not lossy, or beyond the bound")
    scattered = comm.stats.bytes_by_op["reduce_scatter"]
    if scattered != world * packed_bytes(n):
        problems.append(f"reduce-scatter counted {scattered} bytes, expected {world * packed_bytes(n)}")
    return problems


# -- training ------------------------------------------------------------------------------------------------
def _train(rank: int, case: dict[str, Any], **flags: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Blocks(case.get("reentrant"), width=32, hidden=256)  # every shard large enough for int8
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    zero.update(reduce_bucket_size=20000, allgather_bucket_size=20000, **flags)
    precision = case.get("precision", "fp32")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 20},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    losses = []
    for step in range(case.get("steps", 4)):
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            loss = engine(torch.randn(4, 32, generator=g).to(dtype))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    trained_bytes = dict(engine.comm.stats.bytes_by_op)  # the training's traffic, before the checks below
    probe = engine(torch.ones(4, 32).to(dtype)).detach().reshape(1)  # the same input on every rank
    outputs = [torch.empty(1, dtype=probe.dtype) for _ in range(WORLD)]
    torch.distributed.all_gather(outputs, probe)
    with engine.gathered_parameters():
        final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    # A gather whose values go back into the masters is exact, never int8: written back unchanged, the
    # (fp32) masters stay as they were.
    masters = [sl.master.detach().clone() for sl in engine.sharded_step.slices]
    with zeroshard.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        pass
    slices = engine.sharded_step.slices
    return {
        "masters_kept": all(torch.equal(m, sl.master) for m, sl in zip(masters, slices, strict=True)),
        "final": final,
        "bytes": trained_bytes,
        "losses": losses,
        "same_on_every_rank": all(torch.equal(o, outputs[0]) for o in outputs),
        "skipped": engine.skipped_steps,
    }


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)


def _training(rank: int, world: int) -> list[str]:
    problems = []
    for precision, ratio in (("fp32", (0.25, 0.3)), ("bf16", (0.5, 0.6))):
        case = {"precision": precision}
        plain = _train(rank, case)
        both = _train(rank, case, zero_quantized_weights=True, zero_quantized_gradients=True)
        distance = _distance(both["final"], plain["final"])
        limit = 0.15
        if not 0 < distance < limit:
            problems.append(f"{precision}: quantized parameters {distance:.2e} from the plain run's")
        if not both["same_on_every_rank"]:
            problems.append(f"{precision}: the ranks computed with different parameters")
        if precision == "fp32" and not both["masters_kept"]:
            problems.append("fp32: writing back unchanged parameters under qwZ moved the masters")
        for op in ("all_gather", "reduce_scatter"):
            got = both["bytes"][op] / plain["bytes"][op]
            if not ratio[0] < got < ratio[1]:
                problems.append(f"{precision}: {op} bytes {got:.3f} of the plain run's, expected {ratio}")
    # Hybrid sharding (MiCS 2 of 4): the quantized collectives run inside the shard groups.
    plain = _train(rank, {}, mics_shard_size=2)
    both = _train(rank, {}, mics_shard_size=2, zero_quantized_weights=True, zero_quantized_gradients=True)
    fractions = [both["bytes"][op] / plain["bytes"][op] for op in ("all_gather", "reduce_scatter")]
    if not 0 < _distance(both["final"], plain["final"]) < 0.15 or not all(0.25 < f < 0.3 for f in fractions):
        problems.append(f"MiCS: {_distance(both['final'], plain['final']):.2e} apart, bytes {fractions}")
    if not both["same_on_every_rank"]:
        problems.append("MiCS: the ranks computed with different parameters")
    # hpZ's secondary shards hold the dequantized forward gather: the backward computes with the same values.
    for reentrant in (None, False):
        case = {"reentrant": reentrant}
        alone = _train(rank, case, zero_quantized_weights=True)
        hpz = _train(rank, case, zero_quantized_weights=True, zero_hpz_partition_size=2)
        changed = [n for n, v in alone["final"].items() if not torch.equal(v, hpz["final"][n])]
        if changed or alone["losses"] != hpz["losses"]:
            problems.append(f"hpZ over qwZ (reentrant {reentrant}) differs from qwZ alone: {changed}")
    # fp16 overflow (a loss scale of 2**20: 6 of 8 steps skip) travels through int8 gradients: the same skips.
    case = {"precision": "fp16", "steps": 8}
    plain, quantized = _train(rank, case), _train(rank, case, zero_quantized_gradients=True)
    if not 0 < plain["skipped"] < 8 or quantized["skipped"] != plain["skipped"]:
        problems.append(f"fp16 skipped steps: plain {plain['skipped']}, quantized {quantized['skipped']}")
    problems += _write_back_inside_forward(rank)
    return problems


def _write_back_inside_forward(rank: int) -> list[str]:
    """A module's parameters gathered in int8 for its forward cannot be written back: the error says so on
    every rank, instead of rounding the unit's masters."""
    torch.manual_seed(0)
    model = Blocks(None, width=32, hidden=256)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": True}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeroshard.initialize(model=model, config={**config, "zero_optimization": zero})
    linear = model.blocks[0][0]

    def modify(module: torch.nn.Module, args: Any) -> None:
        with zeroshard.zero.GatheredParameters([module.weight], modifier_rank=0):
            module.weight.data.mul_(0.5)

    linear.register_forward_pre_hook(modify)
    try:
        engine(torch.randn(4, 32))
    except RuntimeError as err:
        return [] if "int8" in str(err) else [f"write-back inside forward: {err}"]
    return ["write-back of an int8 gather inside forward was not refused"]


def worker(rank: int, world_size: int) -> list[str]:
    return _collectives(rank, world_size) + _training(rank, world_size)


def test_quantized_collectives_at_w4() -> None:
    results = run_distributed(worker, WORLD, timeout=560)
    assert results == [[]] * WORLD, results
