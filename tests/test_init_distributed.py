"""``deepspeed.init_distributed`` / ``zeroshard.init_distributed`` pass ``init_method``, ``rank``,
``world_size`` and ``timeout`` on to torch, so a ``file://`` (or ``tcp://``) rendezvous needs no launcher
variable, as in DeepSpeed (its unit-test harness joins exactly so)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zeroshard
import zeroshard.deepspeed as deepspeed
from tests.distributed import run_distributed
from zeroshard.dist import validate_rank

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _rejoin(
    join: Callable[..., object], rank: int, world_size: int, rendezvous: str
) -> tuple[int, int, float]:
    """Leave the harness's group, join again through ``join`` with no launcher variable set."""
    dist.barrier()
    dist.destroy_process_group()
    for name in LAUNCHER:
        os.environ.pop(name, None)
    timeout = datetime.timedelta(seconds=45)
    join("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size, timeout=timeout)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return dist.get_rank(), dist.get_world_size(), float(total)


def rejoin_worker(rank: int, world_size: int, tmp: str) -> list[tuple[int, int, float]]:
    out = [_rejoin(zeroshard.init_distributed, rank, world_size, os.path.join(tmp, "a"))]
    out.append(_rejoin(deepspeed.init_distributed, rank, world_size, os.path.join(tmp, "b")))
    assert os.environ["RANK"] == str(rank)  # the DeepSpeed layer also fills in the launcher variables
    return out


@pytest.mark.timeout(200)
def test_file_rendezvous_with_rank_and_world_size_and_no_launcher(tmp_path: Path) -> None:
    results = run_distributed(rejoin_worker, 2, str(tmp_path))
    for rank, joins in enumerate(results):
        assert joins == [(rank, 2, 3.0), (rank, 2, 3.0)]


def test_rank_and_world_size_are_checked() -> None:
    validate_rank(-1, -1)
    validate_rank(1, 2)
    with pytest.raises(TypeError, match=r"rank='0'.*expected an int"):
        validate_rank("0", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"world_size=-2"):
        validate_rank(0, -2)
    with pytest.raises(ValueError, match=r"rank=2, world_size=2 .*0 <= rank < world_size"):
        validate_rank(2, 2)
    with pytest.raises(ValueError, match=r"world_size=0"):
        zeroshard.init_distributed(world_size=0)


def test_without_launcher_url_or_world_size_nothing_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    assert zeroshard.init_distributed(rank=0) is False
    assert not dist.is_initialized()


EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist
import zeroshard
zeroshard.init_distributed()
t = torch.ones(1000)
for _ in range(50):
    dist.all_reduce(t)
print("exit-ok", dist.get_rank(), flush=True)
"""


@pytest.mark.timeout(300)
def test_a_script_that_never_destroys_its_group_exits_cleanly(tmp_path: Path) -> None:
    """[Note: destroy the group at exit]: without the exit hook, torch 2.13 aborts such a worker at exit
    (SIGABRT, "terminate called without an active exception") in most runs on this machine; four
    launches in a row must all exit 0."""
    script = tmp_path / "no_destroy.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for attempt in range(4):
        done = subprocess.run([*command, str(script)], env=env, capture_output=True, text=True, timeout=120)
        log = done.stdout + done.stderr
        assert done.returncode == 0, f"launch {attempt}:\n{log[-4000:]}"
        assert log.count("exit-ok") == 2 and "terminate called" not in log, log[-4000:]


def test_dist_init_required_false_needs_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dist_init_required=False`` promises a joined group. Where a launcher started several processes
    and none is joined, every entry point refuses (a ``UsageError``, also DeepSpeed's ``AssertionError``)
    instead of letting each process train alone as world size 1; DeepSpeed's ``init_distributed`` refuses
    it always. One process without a launcher still trains through zeroshard's own ``initialize``."""
    assert not dist.is_initialized()
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeroshard.initialize(model=torch.nn.Linear(2, 2), config=config, dist_init_required=False)
    assert engine.comm.world_size == 1
    engine.destroy()
    with pytest.raises(AssertionError, match=r"dist_init_required=False\): torch.distributed is not"):
        deepspeed.init_distributed("gloo", dist_init_required=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    calls: list[Callable[[], object]] = [
        lambda: zeroshard.initialize(model=torch.nn.Linear(2, 2), config=config, dist_init_required=False),
        lambda: deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config, dist_init_required=False),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="not initialized although WORLD_SIZE=2") as info:
            call()
        assert isinstance(info.value, AssertionError)
    assert not dist.is_initialized()
