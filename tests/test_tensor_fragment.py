"""DeepSpeed's ``safe_get_full_*`` / ``safe_set_full_*`` (zeroshard/deepspeed/utils/tensor_fragment.py) at
stages 1-3, W=2, and with hybrid sharding (``mics_shard_size`` 2 of W=4): the parameter, its gradient and
AdamW's two moments against one process training on every rank's batches; setters read back; errors named.
The ``safe_*_local_*`` functions at stage 3 (fp32 and bf16): every rank's part, in rank order, is the full
value, and is ``_ds_tensor(param)``'s elements; frozen parameters read ``None`` and ignore writes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from zeroshard.deepspeed import initialize as deepspeed_initialize
from zeroshard.deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zeroshard.zero import GatheredParameters

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
    if not torch.equal(_got(safe_get_full_optimizer_state(param, "exp_avg")), value):
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
    if not torch.equal(_got(safe_get_full_grad(param)), value):
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


def _parts_make_whole(local: torch.Tensor | None, whole: torch.Tensor | None) -> bool:
    """Whether every rank's ``local`` part, in rank order, is ``whole`` (collective)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, None if local is None else local.detach().cpu())
    if whole is None or any(p is None for p in parts):
        return False
    return torch.equal(torch.cat(parts), whole.detach().reshape(-1).cpu())


def _got(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor


def _ds_tensor(param: nn.Parameter) -> torch.Tensor:
    tensor: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    return tensor


def _local_case(rank: int, dtype: str) -> list[str]:
    problems: list[str] = []
    model = _model()
    frozen = model.get_parameter("0.bias")
    frozen.requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        **({"bf16": {"enabled": True}} if dtype == "bf16" else {}),
    }
    engine, *_ = deepspeed_initialize(model=model, config=config)  # presents ds_tensor
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.bfloat16() if dtype == "bf16" else tensor

    x, y = _batch(0, rank)
    engine.backward(nn.functional.mse_loss(engine(cast(x)), cast(y)))
    for i, param in enumerate(params):
        local = safe_get_local_fp32_param(param)
        if local is None or not torch.equal(local, _ds_tensor(param)):
            problems.append(f"{dtype} param {i}: the local part is not ds_tensor's elements")
        if not _parts_make_whole(local, safe_get_full_fp32_param(param)):
            problems.append(f"{dtype} param {i}: the local fp32 parts do not make the whole")
        if not _parts_make_whole(safe_get_local_grad(param), safe_get_full_grad(param)):
            problems.append(f"{dtype} param {i}: the local gradient parts do not make the whole")
    # The vectorized update and the local gradient write land where step() reads them.
    before = [safe_get_full_grad(p) for p in params]
    safe_update_full_grad_vectorized(params, lambda grad, param: grad * 2)
    for i, (param, grad) in enumerate(zip(params, before, strict=True)):
        if grad is None or not torch.equal(_got(safe_get_full_grad(param)), grad * 2):
            problems.append(f"{dtype} param {i}: safe_update_full_grad_vectorized")
        safe_set_local_grad(param, torch.zeros_like(_ds_tensor(param), dtype=_got(grad).dtype))
        if _got(safe_get_full_grad(param)).count_nonzero():
            problems.append(f"{dtype} param {i}: zeroed local gradient parts read back nonzero")
    engine.step()
    for i, param in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            local_state = safe_get_local_optimizer_state(param, key)
            if not _parts_make_whole(local_state, safe_get_full_optimizer_state(param, key)):
                problems.append(f"{dtype} param {i}: the local {key} parts do not make the whole")
        safe_set_local_optimizer_state(param, torch.full_like(_ds_tensor(param), float(rank + 1)), "exp_avg")
        state = safe_get_local_optimizer_state(param, "exp_avg")
        if state is None or (state.numel() and not bool((state == rank + 1).all())):
            problems.append(f"{dtype} param {i}: exp_avg written locally reads back wrong")
        # A local master write reaches the parameter the next forward gathers (bf16: rounded).
        value = torch.arange(_ds_tensor(param).numel(), dtype=torch.float32) + 10 * rank
        safe_set_local_fp32_param(param, value)
        whole = _got(safe_get_full_fp32_param(param))
        with GatheredParameters([param]):
            if not torch.equal(param.detach().reshape(-1), cast(whole.reshape(-1))):
                problems.append(f"{dtype} param {i}: a local master write did not reach the parameter")
        if not _parts_make_whole(value, whole):
            problems.append(f"{dtype} param {i}: local master writes do not make the whole")
    # A frozen parameter: DeepSpeed maps no master to it, so None and no-ops.
    reads = [safe_get_full_fp32_param(frozen), safe_get_full_grad(frozen), safe_get_local_grad(frozen)]
    reads += [safe_get_full_optimizer_state(frozen, "exp_avg"), safe_get_local_fp32_param(frozen)]
    if any(r is not None for r in reads):
        problems.append(f"{dtype}: a frozen parameter read {reads}")
    kept = frozen.detach().clone()
    safe_set_full_fp32_param(frozen, kept + 1)
    safe_set_local_fp32_param(frozen, kept + 1)
    if not torch.equal(frozen.detach(), kept):
        problems.append(f"{dtype}: a frozen parameter was written")
    engine.destroy()
    return problems


def _stage2_refuses_local(rank: int) -> list[str]:
    engine, *_ = zeroshard.initialize(
        model=_model(), config={"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}}
    )
    try:
        safe_get_local_fp32_param(next(engine.module.parameters()))
        return ["stage 2: a local read was answered"]
    except ValueError as err:
        return [] if "stage 2" in str(err) and "safe_get_full_" in str(err) else [f"stage 2: {err}"]
    finally:
        engine.destroy()


def local_worker(rank: int, world_size: int) -> list[str]:
    return _local_case(rank, "fp32") + _local_case(rank, "bf16") + _stage2_refuses_local(rank)


def test_local_parts_and_frozen_parameters_at_w2() -> None:
    assert run_distributed(local_worker, 2, timeout=280) == [[], []]
