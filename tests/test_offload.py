"""Offload (ZeRO-Offload / ZeRO-Infinity): offloaded and in-memory training give identical parameters.

Stepping sub-groups one at a time from an NVMe file must change nothing numerically: torch skips slices
without a gradient and every supported optimizer is elementwise, so the comparison is exact (torch.equal),
in fp32 and in bf16, for the parameters and for the optimizer state after every step.
"""

from __future__ import annotations

import copy
import os
import tempfile
from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import batch, make_model, two_groups
from zeroshard.config import ConfigWarning

STEPS = 3


def _config(stage: int, gas: int, clip: float, precision: str, offload: dict[str, Any]) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 60, **offload}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=56, stage3_prefetch_bucket_size=50)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": zero,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _offload_block(device: str, directory: str, sub_group_size: int, params: bool) -> dict[str, Any]:
    block: dict[str, Any] = {
        "offload_optimizer": {"device": device, "nvme_path": directory if device == "nvme" else None},
        "sub_group_size": sub_group_size,
    }
    if params:
        block["offload_param"] = {"device": device, "nvme_path": directory if device == "nvme" else None}
    return block


def _engine(config: dict[str, Any], opt: str) -> tuple[Any, torch.nn.Module]:
    model = make_model(0)
    if opt == "SGD":
        kwargs: dict[str, Any] = {"optimizer": torch.optim.SGD(two_groups(model), momentum=0.9)}
    else:
        kwargs = {"model_parameters": two_groups(model)}
        config = {**config, "optimizer": {"type": opt, "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config, **kwargs)
    return engine, model


def _state(engine: Any) -> list[torch.Tensor]:
    state = engine.optimizer.state
    with engine.offload.resident(write_back=False):
        return [
            t.detach().clone()
            for sl in engine.sharded_step.slices
            for _, t in sorted(state.get(sl.master, {}).items())
            if isinstance(t, torch.Tensor)
        ]


def run_case(rank: int, world_size: int, case: dict[str, Any], directory: str) -> int:
    stage, gas, clip, precision, opt = (case[k] for k in ("stage", "gas", "clip", "precision", "opt"))
    base = _config(stage, gas, clip, precision, {})
    offload = _offload_block(case["device"], directory, case["sub_group_size"], case["params"])
    ref, ref_model = _engine(copy.deepcopy(base), opt)
    eng, model = _engine(_config(stage, gas, clip, precision, offload), opt)
    files = sorted(f for f in os.listdir(directory) if f"rank{rank}" in f and f.endswith(".swp"))
    if case["device"] == "nvme":
        wanted = ["optimizer"] + (["param"] if case["params"] else [])
        assert [f.split("-")[1] for f in files] == sorted(wanted), files
        # The masters really left memory (fp32 stages 1-2 and stage 3's persistent units keep theirs: it is
        # the parameters' own shard).
        offloaded = [u.master.numel() == 0 for u in eng.units]
        assert offloaded == [u.separate_master for u in eng.units], offloaded
        assert any(offloaded) == (precision == "bf16" or stage == 3), offloaded
    else:
        assert files == [] and eng.offload.optimizer_swapper is None
    rare_at = lambda s, m, r: s == 1 and m == 0 and r == 0  # noqa: E731  (one rank uses `rare` once)
    for step in range(STEPS):
        for micro in range(gas):
            x, y = batch(step, micro, rank, rare_at=rare_at)
            for engine in (ref, eng):
                engine.backward(engine(x, y))
                engine.step()
        with ref.gathered_parameters(), eng.gathered_parameters():
            for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
                assert torch.equal(p.detach(), q.detach()), f"{case} step {step}: {name} differs"
        mine, theirs = _state(eng), _state(ref)
        assert len(mine) == len(theirs) and all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert eng.get_global_grad_norm() == ref.get_global_grad_norm()
    eng.destroy()
    ref.destroy()
    left = [f for f in os.listdir(directory) if f"rank{rank}" in f]
    assert not left, f"offload files left after destroy(): {left}"
    return 1


def offload_worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> int:
    done = 0
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            # Every rank must use the same directory name: rank 0 makes it and tells the others.
            directory = [tmp] if rank == 0 else [None]
            torch.distributed.broadcast_object_list(directory, src=0)
            done += run_case(rank, world_size, case, str(directory[0]))
            torch.distributed.barrier()
    return done


def _cases() -> list[dict[str, Any]]:
    cases = []
    for stage in (1, 2, 3):
        for device, sub_group_size, params in (
            ("nvme", 40, stage == 3),
            ("nvme", 10**9, False),
            ("cpu", 40, False),
        ):
            for precision, opt, gas, clip in (
                ("fp32", "AdamW", 2, 0.05),
                ("bf16", "Adam", 1, 1.0),
                ("fp32", "SGD", 1, 0.0),
            ):
                cases.append(
                    {
                        "stage": stage,
                        "device": device,
                        "sub_group_size": sub_group_size,
                        "params": params,
                        "precision": precision,
                        "opt": opt,
                        "gas": gas,
                        "clip": clip,
                    }
                )
    return cases


# -- checkpoints ------------------------------------------------------------------------------------------


def _train(engine: Any, steps: range, rank: int) -> None:
    for step in steps:
        x, y = batch(step, 0, rank)
        engine.backward(engine(x, y))
        engine.step()


def _params(engine: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    with engine.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def checkpoint_worker(rank: int, world_size: int, directory: str) -> int:
    """Save with NVMe offload mid-run; resuming (offloaded, or in memory) continues exactly."""
    cases = 0
    for stage, precision in ((2, "bf16"), (3, "fp32"), (1, "fp32")):
        nvme = os.path.join(directory, f"nvme{stage}")
        ckpt = os.path.join(directory, f"ckpt{stage}")
        if rank == 0:
            os.makedirs(nvme, exist_ok=True)
        torch.distributed.barrier()
        offload = _offload_block("nvme", nvme, 40, params=stage == 3)
        config = _config(stage, 1, 1.0, precision, offload)
        first, model = _engine(config, "AdamW")
        _train(first, range(2), rank)
        first.save_checkpoint(ckpt, tag="mid")
        _train(first, range(2, 4), rank)
        want, want_state = _params(first, model), _state(first)
        first.destroy()
        for resumed_config in (config, _config(stage, 1, 1.0, precision, {})):
            resumed, resumed_model = _engine(resumed_config, "AdamW")
            _train(resumed, range(5, 6), rank)  # some other training first: the load must replace it all
            resumed.load_checkpoint(ckpt, tag="mid")
            _train(resumed, range(2, 4), rank)
            got = _params(resumed, resumed_model)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (stage, resumed_config)
            state = _state(resumed)
            assert len(state) == len(want_state)
            assert all(torch.equal(a, b) for a, b in zip(state, want_state, strict=True)), stage
            resumed.destroy()
            cases += 1
    return cases


def training_and_checkpoint_worker(
    rank: int, world_size: int, cases: list[dict[str, Any]], directory: str
) -> tuple[int, int]:
    return offload_worker(rank, world_size, cases), checkpoint_worker(rank, world_size, directory)


# One spawn for both (the two tests' former limits, 300 s and 240 s, less one start-up).
@pytest.mark.timeout(480)
def test_offloaded_training_is_identical_and_resumes_exactly(tmp_path: Any) -> None:
    """Offloaded and in-memory training give identical parameters; a checkpoint saved with NVMe offload
    mid-run resumes exactly, offloaded or in memory."""
    cases = _cases()
    results = run_distributed(training_and_checkpoint_worker, 2, cases, str(tmp_path), timeout=460)
    assert results == [(len(cases), 6)] * 2


# -- start-up checks ---------------------------------------------------------------------------------------


def _nvme_config(path: str, stage: int = 2, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": path}},
        **extra,
    }


def test_start_up_errors_name_the_key_and_the_numbers(tmp_path: Any, monkeypatch: Any) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"zero_optimization\.offload_optimizer\.nvme_path.*does not exist"):
        zeroshard.initialize(model=make_model(), config=_nvme_config(missing))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path.*not a directory"):
        zeroshard.initialize(model=make_model(), config=_nvme_config(str(a_file)))
    no_path = _nvme_config(str(tmp_path))
    del no_path["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path: required"):
        zeroshard.initialize(model=make_model(), config=no_path)
    no_optimizer = _nvme_config(str(tmp_path))
    del no_optimizer["optimizer"]
    with pytest.raises(ValueError, match=r"offload_optimizer\.device: \"nvme\" needs an optimizer"):
        zeroshard.initialize(model=make_model(), config=no_optimizer)
    import zeroshard.offload.swapfile as swapfile

    monkeypatch.setattr(swapfile, "_free_bytes", lambda directory: 1000)
    with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path.*needs .*GB.*1000 bytes\) free"):
        zeroshard.initialize(model=make_model(), config=_nvme_config(str(tmp_path)))
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".swp")]


def test_offload_where_it_changes_nothing_says_so(tmp_path: Any, caplog: Any) -> None:
    with pytest.warns(ConfigWarning, match="offload_optimizer has no effect at stage 0"):
        engine, *_ = zeroshard.initialize(model=make_model(), config=_nvme_config(str(tmp_path), stage=0))
    _train(engine, range(1), 0)
    assert engine.offload.optimizer_swapper is None and not os.listdir(tmp_path)
    caplog.clear()
    config = _nvme_config(str(tmp_path), stage=3)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    with caplog.at_level("WARNING"):
        engine, *_ = zeroshard.initialize(model=make_model(), config=config)
    assert "offload_optimizer.device 'cpu': training runs on the CPU" in caplog.text
    assert "offload_param.device 'nvme' is ignored" in caplog.text
    engine.destroy()


SCRIPT = """
import sys, torch, zeroshard
from tests.models import make_model, batch
engine, *_ = zeroshard.initialize(model=make_model(), config={config!r})
x, y = batch(0, 0, 0)
engine.backward(engine(x, y)); engine.step()
print("trained", flush=True)
{ending}
"""


@pytest.mark.timeout(120)
def test_offload_files_are_removed_on_exit_and_stale_ones_replaced(tmp_path: Any) -> None:
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = _nvme_config(str(tmp_path))

    def run(ending: str) -> subprocess.CompletedProcess[str]:
        code = SCRIPT.format(config=config, ending=ending)
        return subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=100
        )

    clean = run("")  # a clean exit without destroy(): the files go with the interpreter
    assert clean.returncode == 0 and "trained" in clean.stdout, clean.stderr
    assert not os.listdir(tmp_path)
    crashed = run("import os; os._exit(3)")  # no clean-up at all: the files stay
    assert crashed.returncode == 3 and "trained" in crashed.stdout, crashed.stderr
    left = sorted(os.listdir(tmp_path))
    assert any(f.endswith(".swp") for f in left), left
    again = run("")  # the next run finds them unlocked, replaces them with a warning, trains
    assert again.returncode == 0 and "trained" in again.stdout, again.stderr
    assert "zeroshard-optimizer-rank0.swp" in again.stderr
    assert not os.listdir(tmp_path)
