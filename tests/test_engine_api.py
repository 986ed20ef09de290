"""The engine's DeepSpeed-shaped API: counters, no_sync, schedulers and param_groups edits, bad input."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model, two_groups


def _config(stage: int, gas: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        **extra,
    }


def _global(step: int, micro: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, micro, r) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum keeps rounding differences proportional (Adam amplifies them near g = 0; see
    # test_parity), so these API tests can hold the tight tolerance.
    return torch.optim.SGD(two_groups(model), momentum=0.9)


def _assert_same(model: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        err = float((p.detach() - q.detach()).abs().max())
        assert err <= 1e-6 * float(q.detach().abs().max()) + 1e-7, f"{what} {name}: {err}"


def no_sync_cases(rank: int, world_size: int) -> None:
    for stage in (0, 1):
        model, gas = make_model(0), 3
        ref = copy.deepcopy(model)
        ref_opt = _sgd(ref)
        engine, _, _, _ = zeroshard.initialize(model=model, optimizer=_sgd(model), config=_config(stage, gas))
        for step in range(2):
            for micro in range(gas):
                loss = engine(*batch(step, micro, rank))
                if micro < gas - 1:
                    with engine.no_sync():
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                engine.step()
                (ref(*_global(step, micro, world_size)) / gas).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            _assert_same(model, ref, f"no_sync stage {stage} step {step}")
        # A boundary backward under no_sync leaves gradients unreduced: step() must refuse.
        for micro in range(gas):
            loss = engine(*batch(9, micro, rank))
            with engine.no_sync():
                engine.backward(loss)
            if micro < gas - 1:
                engine.step()
        with pytest.raises(RuntimeError, match="no_sync"):
            engine.step()
    engine, _, _, _ = zeroshard.initialize(model=make_model(0), config=_config(2))
    with pytest.raises(RuntimeError, match="stage 2"):
        with engine.no_sync():
            pass


def scheduler_and_group_edits(rank: int, world_size: int) -> None:
    # A client scheduler built on the client optimizer keeps driving the shards.
    model = make_model(0)
    ref = copy.deepcopy(model)
    opt = _sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = _sgd(ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    engine, zopt, _, zsched = zeroshard.initialize(
        model=model, optimizer=opt, lr_scheduler=sched, config=_config(2)
    )
    assert zopt is opt and zsched is sched
    for step in range(3):
        engine.backward(engine(*batch(step, 0, rank)))
        engine.step()
        ref(*_global(step, 0, world_size)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        _assert_same(model, ref, f"StepLR step {step}")
    assert engine.get_lr() == pytest.approx(ref_sched.get_last_lr())
    # An edit by hand: lr 0 for the first group freezes exactly those parameters.
    before = [p.detach().clone() for p in model.lin1.parameters()]
    other = model.lin2.weight.detach().clone()
    zopt.param_groups[0]["lr"] = 0.0
    zopt.param_groups[0]["weight_decay"] = 0.0
    engine.backward(engine(*batch(5, 0, rank)))
    engine.step()
    for b, p in zip(before, model.lin1.parameters(), strict=True):
        assert torch.equal(b, p.detach())
    assert not torch.equal(other, model.lin2.weight.detach())


def counters_and_dataloader(rank: int, world_size: int) -> None:
    data = TensorDataset(torch.arange(40).reshape(20, 2) % 11, torch.arange(40).reshape(20, 2) % 11)
    model = make_model(0)
    engine, _, loader, _ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        training_data=data,
        config=_config(1, 3, optimizer={"type": "SGD", "params": {"lr": 0.1}}),
    )
    assert loader is not None
    seen = []
    boundaries = []
    for x, y in loader:
        assert x.shape[0] <= 2
        seen.append(x[:, 0].tolist())
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x, y))
        engine.step()
    assert boundaries[:3] == [False, False, True]
    assert engine.micro_steps == len(loader) == 5
    assert engine.global_steps == 1 and engine.global_samples == 2 * 3 * world_size
    assert engine.world_size == world_size and engine.global_rank == rank
    assert engine.zero_optimization_stage() == 1 and engine.get_lr() == [0.1]
    assert engine.get_global_grad_norm() is not None
    engine.eval()
    assert not engine.module.training
    engine.train()
    assert engine.module.training
    return None


def bad_input(rank: int, world_size: int) -> None:
    engine, _, _, _ = zeroshard.initialize(
        model=make_model(0), config=_config(1, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
    )
    with pytest.raises(RuntimeError, match="found no gradients"):
        engine.step()
    with pytest.raises(ValueError, match="scalar"):
        engine.backward(torch.ones(3, requires_grad=True) * 2)
    with pytest.raises(ValueError, match="train_batch_size"):
        zeroshard.initialize(
            model=make_model(0), config={"train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}
        )


def api_worker(rank: int, world_size: int) -> None:
    no_sync_cases(rank, world_size)
    scheduler_and_group_edits(rank, world_size)
    counters_and_dataloader(rank, world_size)
    bad_input(rank, world_size)


def test_engine_api_world_size_2() -> None:
    run_distributed(api_worker, 2)


def diverging_ranks(rank: int, world_size: int, done_file: str) -> str:
    engine, _, _, _ = zeroshard.initialize(
        model=make_model(0), config=_config(0, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    )
    done = Path(done_file)
    if rank == 1:  # never joins the gradient all-reduce; stays alive until rank 0 has raised
        deadline = time.monotonic() + 120
        while not done.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 never reported its timeout")
            time.sleep(0.05)
        return "skipped"
    try:
        with pytest.raises(RuntimeError, match=r"rank 0: engine.backward \(step 0\): .*gradient all_reduce"):
            engine.backward(engine(*batch(0, 0, rank)))
    finally:
        done.touch()
    return "raised"


def test_a_collective_that_cannot_complete_raises_within_the_timeout(tmp_path: Path) -> None:
    # Without the timeout rank 0 would wait forever; run_distributed's own limit would then fail the test.
    results = run_distributed(diverging_ranks, 2, str(tmp_path / "rank0-done"), collective_timeout=3)
    assert results == ["raised", "skipped"]


def test_single_process_errors_and_helpers() -> None:
    with pytest.raises(ValueError, match="model"):
        zeroshard.initialize(model=None, config=_config(0))
    with pytest.raises(ValueError, match="config"):
        zeroshard.initialize(model=make_model(0), config=_config(0), config_params=_config(1))
    half = make_model(0).half()
    with pytest.raises(ValueError, match="float16"):
        zeroshard.initialize(model=half, config=_config(0))
    assert zeroshard.init_distributed() is False  # no launcher: world size 1
    parser = zeroshard.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--zeroshard_config", "ds.json"])
    assert args.deepspeed_config == "ds.json"


def test_engine_feeds_the_csv_monitor_and_timers(tmp_path: Any) -> None:
    config = _config(
        2,
        2,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "run"},
        wall_clock_breakdown=True,
        optimizer={"type": "SGD", "params": {"lr": 0.1}},
    )
    model = make_model(0)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for step in range(3):
        for micro in range(2):
            loss = engine(*batch(step, micro, 0))
            losses.append(float(loss.detach()))
            engine.backward(loss)
            engine.step()
        # A script's own events go to the same monitors (DeepSpeed-Chat logs its eval scores so).
        assert engine.monitor.enabled
        reward = torch.tensor(0.25 * step)
        engine.monitor.write_events([("Eval/Samples/reward", reward, engine.global_samples)])
    engine.destroy()
    rows = (tmp_path / "run" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert len(rows) == 1 + 3  # header and one row per optimizer step, x = global samples
    first = rows[1].split(",")
    assert int(first[0]) == 4 and float(first[1]) == pytest.approx((losses[0] + losses[1]) / 2, rel=1e-5)
    assert set(engine.telemetry.timings()) >= {"forward", "backward", "reduce", "step"}
    rewards = (tmp_path / "run" / "Eval_Samples_reward.csv").read_text()
    assert rewards == "step,reward\n4,0.0\n8,0.25\n12,0.5\n"
    quiet, *_ = zeroshard.initialize(model=make_model(0), config=_config(1, 1, optimizer=config["optimizer"]))
    assert not quiet.monitor.enabled
    quiet.monitor.write_events([("Eval/acc", 1.0, 1)])  # no monitor: nothing is written, nothing fails


def test_throughput_timer_follows_forward_and_step() -> None:
    """engine.tput_timer runs from each forward to its step(), as DeepSpeed's engine drives it;
    ``timers.throughput.enabled: false`` counts nothing."""
    for enabled in (True, False):
        config = _config(1, 3, optimizer={"type": "SGD", "params": {"lr": 0.1}})
        config["timers"] = {"throughput": {"enabled": enabled, "synchronized": True}}
        model = make_model(0)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        timer = engine.tput_timer
        assert (timer.batch_size, timer.start_step, timer.initialized) == (6, 2, False)
        for step in range(4):
            for micro in range(3):
                loss = engine(*batch(step, micro, 0))
                assert timer.started is enabled
                engine.backward(loss)
                time.sleep(0.002)
                engine.step()
                assert not timer.started
            expected = (3 * (step + 1), step + 1) if enabled else (0, 0)
            assert (timer.micro_step_count, timer.global_step_count) == expected
            assert (timer.total_elapsed_time > 0) is (enabled and step >= 2), step
        if enabled:
            # Two measured optimizer steps of three micro-steps, each over 2 ms between forward and step.
            assert 0.012 <= timer.total_elapsed_time
            assert timer.avg_samples_per_sec() == pytest.approx(6 / (timer.total_elapsed_time / 2))
        else:
            assert timer.avg_samples_per_sec() == float("-inf")
        engine.destroy()


def test_compute_grad_norm_false_trains_the_same_without_a_norm() -> None:
    """DeepSpeed 0.19.8's zero_optimization.compute_grad_norm: false (stages 1-2, no clipping): the same
    parameters as with it on, get_global_grad_norm() None instead of the norm."""
    trained = []
    for compute in (True, False):
        config = _config(2, 2, optimizer={"type": "AdamW", "params": {"lr": 0.01}})
        config["zero_optimization"]["compute_grad_norm"] = compute
        model = make_model(0)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        assert engine.zero_compute_grad_norm() is compute
        for step in range(2):
            for micro in range(2):
                engine.backward(engine(*batch(step, micro, 0)))
                engine.step()
        norm = engine.get_global_grad_norm()
        assert (norm is None) is (not compute) and (norm is None or norm > 0), norm
        trained.append([p.detach().clone() for p in model.parameters()])
        engine.destroy()
    for with_norm, without in zip(*trained, strict=True):
        assert torch.equal(with_norm, without)


def test_disable_python_gc_holds_the_collector_off_while_an_engine_lives() -> None:
    """DeepSpeed 0.19.8's top-level disable_python_gc: automatic collection off from the first engine that
    asks until the last is destroyed; a forked child (a DataLoader worker) collects as before; a collector
    the script turned off itself stays off."""
    import gc
    import os

    def engine(disable: bool) -> Any:
        model = make_model(0)
        config = _config(0, optimizer={"type": "SGD", "params": {"lr": 0.1}}, disable_python_gc=disable)
        return zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    engines: list[Any] = []
    try:
        assert gc.isenabled()
        engines.append(engine(False))
        assert gc.isenabled()
        engines += [engine(True), engine(True)]
        assert not gc.isenabled()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() else 3)
        assert os.waitpid(pid, 0)[1] == 0
        assert isinstance(engines[1].collect_python_gc(), int) and not gc.isenabled()
        engines[1].destroy()
        engines[1].destroy()  # a second destroy releases nothing more
        assert not gc.isenabled()
        engines[2].destroy()
        assert gc.isenabled()
        gc.disable()
        engines.append(engine(True))
        engines[-1].destroy()
        assert not gc.isenabled()
    finally:
        for e in engines:
            e.destroy()
        gc.enable()
