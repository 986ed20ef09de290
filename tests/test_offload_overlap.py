"""CPU offload beside a device, run on a CPU: the overlapped step and the parameter shards in CPU memory.

``tests/fake_copies.py`` makes the offload set-up treat the CPU as a device beside host memory, with copies
that land only when waited for and poison their destination until then. So the code paths meant for a GPU
(``offload_optimizer.device: cpu`` with the overlapped step, ``offload_param.device: cpu``) run here, and a
missing wait, or a copy taken before its source is final, gives a wrong number. Against the same training
in memory every case must be bit-identical (torch.equal): parameters and optimizer state after every step,
and the gradient norm. tests/test_cuda.py runs the same configurations on a GPU.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import zeroshard
from tests.distributed import run_distributed
from tests.fake_copies import simulate_offload_device
from tests.models import batch, make_model, two_groups
from zeroshard.deepspeed.utils.tensor_fragment import safe_get_full_grad, safe_set_full_grad
from zeroshard.offload.host_shards import HostShards

STEPS = 3


class WholeStepSGD(torch.optim.SGD):
    """A client optimizer of a class zeroshard does not know: stepped once per step, never per sub-group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return super().step(closure)


def _config(case: dict[str, Any], offload: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": case["stage"], "reduce_bucket_size": 60, "allgather_bucket_size": 60}
    if case["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=56, stage3_prefetch_bucket_size=50)
    if offload:
        zero["sub_group_size"] = case.get("sub_group_size", 10**9)
        if case.get("opt_cpu", True):
            zero["offload_optimizer"] = {"device": "cpu"}
        if case.get("param_cpu", False):
            zero["offload_param"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": case.get("gas", 1),
        "gradient_clipping": case.get("clip", 0.0),
        "zero_optimization": zero,
    }
    if case.get("precision", "bf16") == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _engine(case: dict[str, Any], offload: bool) -> tuple[Any, torch.nn.Module]:
    model = make_model(0)
    config = _config(case, offload)
    opt = case.get("opt", "AdamW")
    if opt == "client":
        return zeroshard.initialize(
            model=model, config=config, optimizer=WholeStepSGD(two_groups(model), lr=0.1)
        )[0], model
    config["optimizer"] = {"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.01}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config, model_parameters=two_groups(model))
    return engine, model


def _state(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.state
    return [
        t.detach().clone()
        for sl in engine.sharded_step.slices
        for _, t in sorted(state.get(sl.master, {}).items())
        if isinstance(t, torch.Tensor)
    ]


def run_case(rank: int, case: dict[str, Any]) -> None:
    made = simulate_offload_device(read_source=case["read_source"])
    ref, ref_model = _engine(copy.deepcopy(case), offload=False)
    assert not made, "the reference must train in memory"
    eng, model = _engine(case, offload=True)
    assert len(made) == 1, case
    copies = made[0]
    stores = [u.store for u in eng.units]
    assert all(isinstance(s, HostShards) for s in stores), case
    on_host = case.get("param_cpu", False)
    assert [s.prefetches for s in stores] == [on_host and u.plan.shard_parameters for u in eng.units]
    assert (eng.offload.host_step is not None) == case.get("opt_cpu", True)
    rare_at = lambda s, m, r: s == 1 and m == 0 and r == 0  # noqa: E731  (one rank uses `rare` once)
    gas = case.get("gas", 1)
    for step in range(STEPS):
        for micro in range(gas):
            x, y = batch(step, micro, rank, rare_at=rare_at)
            for engine in (ref, eng):
                engine.backward(engine(x, y))
                if case.get("twice"):  # a second loss at the boundary (a GAN's): adds to moved shards
                    engine.backward(engine(*batch(step, micro + 7, rank)))
            if micro == gas - 1 and case.get("opt_cpu", True):
                # The gradient shards started their copies to the CPU during the backward and, at stages
                # 2-3, live there now.
                assert copies.started > 0, case
                homes = eng.offload.host_step._host_grads
                moved = [u.peek_grad_shard() is homes.get(u.index) for u in eng.units if u.holds_grad_shard]
                assert moved and all(moved) == (case["stage"] >= 2), (case, moved)
            if case.get("set_grad") and micro == gas - 1:
                # A gradient written by hand between backward and step reaches the offloaded step.
                for m in (ref_model, model):
                    full = safe_get_full_grad(m.lin1.weight)
                    assert full is not None
                    safe_set_full_grad(m.lin1.weight, full * 0.5 + 0.25)
            for engine in (ref, eng):
                engine.step()
        if case.get("edit"):
            # Parameters changed by hand between steps reach the master and the parameter shard.
            for m in (ref_model, model):
                with zeroshard.zero.GatheredParameters([m.lin1.weight], modifier_rank=0):
                    m.lin1.weight.data.mul_(0.5)
        with ref.gathered_parameters(), eng.gathered_parameters():
            for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
                assert torch.equal(p.detach(), q.detach()), f"{case} step {step}: {name} differs"
        mine, theirs = _state(eng), _state(ref)
        assert len(mine) == len(theirs), case
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), f"{case} step {step}: state"
        assert eng.get_global_grad_norm() == ref.get_global_grad_norm(), case
    # Between steps a shard in CPU memory has no copy on the device (none read ahead of the next forward).
    assert all(s._ahead is None for s in stores), case
    if case.get("opt") == "client":
        assert eng.optimizer.calls == STEPS, "a client optimizer of an unknown class steps once per step"
    if case.get("opt_cpu", True):
        timings = eng.offload.host_step.timings
        assert set(timings) == {"grad_copy_wait_s", "cpu_step_s", "param_copy_wait_s"}, timings
    eng.destroy()
    ref.destroy()


def overlap_worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> int:
    for case in cases:
        run_case(rank, case)
    return len(cases)


def _cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = [
        {"stage": 1, "gas": 2, "clip": 0.05},
        {"stage": 2, "opt": "Adam", "clip": 1.0, "sub_group_size": 40},
        {"stage": 2, "precision": "fp32", "opt": "SGD", "gas": 2},
        {"stage": 2, "opt": "client", "sub_group_size": 40},
        {"stage": 2, "set_grad": True, "clip": 0.05},
        {"stage": 2, "twice": True, "clip": 0.05},
        {"stage": 3, "twice": True, "param_cpu": True},
        {"stage": 3, "clip": 0.05},
        {"stage": 3, "opt_cpu": False, "param_cpu": True, "gas": 2},
        {"stage": 3, "param_cpu": True, "sub_group_size": 40, "clip": 1.0},
        {"stage": 3, "param_cpu": True, "precision": "fp32", "gas": 2},
        {"stage": 3, "param_cpu": True, "set_grad": True},
        {"stage": 3, "opt_cpu": False, "param_cpu": True, "edit": True},
        {"stage": 3, "param_cpu": True, "edit": True},
        {"stage": 2, "edit": True},
    ]
    # Each case with the copies reading their source when waited for, and again when started.
    return [{**case, "read_source": mode} for mode in ("wait", "start") for case in cases]


def test_offload_beside_a_device_matches_training_in_memory() -> None:
    cases = _cases()
    assert run_distributed(overlap_worker, 2, cases, timeout=300) == [len(cases)] * 2


def test_staging_ring_lands_every_piece_once_its_copy_is_waited_for(monkeypatch: Any) -> None:
    """Stepped values cross in staging-buffer pieces; a buffer is reused only after its copy landed."""
    import zeroshard.offload.host_shards as host_shards
    from tests.fake_copies import DeferredCopies

    monkeypatch.setattr(host_shards, "STAGING_ELEMENTS", 16)
    copies = DeferredCopies(read_source="wait")
    ring = host_shards.StagingRing(copies, torch.bfloat16, pin=False)
    values = torch.randn(100, dtype=torch.float32)
    dst = torch.zeros(100, dtype=torch.bfloat16)
    started = ring.send(dst, values)
    assert len(started) == 7 and copies.started == 7
    # Seven pieces through four buffers: the first three were reused, so their copies landed first.
    assert copies.landed == 3 and torch.isnan(dst[48:]).all()
    for copy_ in started:
        copy_.wait()
    assert torch.equal(dst, values.to(torch.bfloat16))
