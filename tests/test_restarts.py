"""Jobs restarted by torchrun, launched with torchrun's defaults, resume where they stopped.

tests/integration_scripts/restart_train.py loads its newest checkpoint at every start and trains through
``initialize(training_data=...)``'s loader. Under ``torchrun --max-restarts 2`` (its agent store shared with
the workers, as by default: [Note: a store per attempt] in zeroshard/attempt_store.py) one fault is
injected per job: a rank SIGKILLed after a random step (static rendezvous), a rank SIGKILLed at a random
file of a save (c10d rendezvous), an agent SIGKILLed with its worker (``--nnodes 1:2``, two agents). The
restarted job must equal the uninterrupted one: bit for bit at the same world size (parameters and every
step's loss), within 1e-6 when it goes on at half the world size. Random choices print their seed
(``ZEROSHARD_TEST_SEED`` replays them).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integration_scripts" / "restart_train.py"
STEPS = 8
STAGE = 3
RUN_TIMEOUT = 240.0


def _seed() -> int:
    return int(os.environ.get("ZEROSHARD_TEST_SEED", str(time.time_ns() % 100_000)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default: the agent's store is shared
    return env


def _start(torchrun: list[str], job: Path, fault: list[str], log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "2", *torchrun, str(SCRIPT)]
    command += ["--ckpt", str(job / "ckpt"), "--out", str(job / "losses"), "--steps", str(STEPS)]
    command += ["--stage", str(STAGE), *fault]
    with open(log, "ab") as out:
        return subprocess.Popen(
            command, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(procs: list[subprocess.Popen[bytes]], logs: list[Path], what: str, killed: int) -> None:
    """Every process exited 0 (``killed`` of them may have been SIGKILLed: an agent the fault killed) within
    RUN_TIMEOUT together, or the test fails with their output."""
    deadline = time.monotonic() + RUN_TIMEOUT
    failed: list[int | None] = []
    for proc in procs:
        try:
            code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        failed.append(code)
    if failed.count(-signal.SIGKILL) != killed or any(c not in (0, -signal.SIGKILL) for c in failed):
        output = "\n".join(log.read_text(errors="replace")[-6000:] for log in logs)
        pytest.fail(f"{what}: exit statuses {failed} (None: still running after {RUN_TIMEOUT} s)\n{output}")


def _run(
    job: Path, torchrun: list[str], fault: str = "", fault_rank: int = 1, agents: int = 1, rdzv_port: int = 0
) -> None:
    job.mkdir()
    logs = [job / f"agent{i}.log" for i in range(agents)]
    args = ["--fault", fault, "--fault-rank", str(fault_rank), "--rdzv-port", str(rdzv_port)] if fault else []
    procs = [_start(torchrun, job, args, log) for log in logs]
    _finish(procs, logs, f"{torchrun} fault={fault!r}", killed=agents - 1)
    if fault:
        assert (job / "ckpt.fault-done").exists(), f"the fault {fault!r} never fired"


def _losses(job: Path) -> dict[int, str]:
    """Each step's loss, as rank 0 logged it last (a restarted job logs the replayed steps again)."""
    lines = (job / "losses").read_text().split()
    return {int(step): loss for step, loss in zip(lines[::2], lines[1::2], strict=True)}


def _starts(job: Path) -> list[int]:
    """The step each start of the job resumed from (0: from scratch)."""
    return [int(line) for line in (job / "losses.starts").read_text().split()]


def _final(job: Path) -> dict[str, torch.Tensor]:
    return torch.load(job / "losses.final.pt")  # type: ignore[no-any-return]


def _assert_same(job: Path, ref: Path, what: str) -> None:
    assert len(_starts(job)) == 2, f"{what}: started {len(_starts(job))} times, expected 2"
    assert _losses(job) == _losses(ref), f"{what}: losses differ"
    got, want = _final(job), _final(ref)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{what}: parameter {name} differs"


@pytest.mark.timeout(900)
def test_a_killed_rank_restarts_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    seed = _seed()
    rng = random.Random(seed)
    ref = tmp_path / "uninterrupted"
    _run(ref, ["--standalone", "--nproc-per-node", "2"])
    assert len(_losses(ref)) == STEPS

    step = rng.randint(1, STEPS - 1)
    static = ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    _run(tmp_path / "static", [*static, "--nproc-per-node", "2"], f"step:{step}")
    _assert_same(
        tmp_path / "static", ref, f"static rendezvous, rank 1 killed after step {step} (seed {seed})"
    )

    save, fsync = rng.choice([2, 4, 6]), rng.randint(1, 7)
    c10d = ["--standalone", "--nproc-per-node", "2"]
    _run(tmp_path / "c10d", c10d, f"save:{save}:{fsync}", fault_rank=0)
    what = f"c10d rendezvous, rank 0 killed at fsync {fsync} of 7 in the save after step {save} (seed {seed})"
    _assert_same(tmp_path / "c10d", ref, what)


@pytest.mark.timeout(900)
def test_losing_an_agent_goes_on_at_half_the_world_size(tmp_path: Path) -> None:
    ref = tmp_path / "uninterrupted"
    _run(ref, ["--standalone", "--nproc-per-node", "2"])
    port = _free_port()
    conf = "join_timeout=60,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    elastic = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
    elastic += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "half", "--rdzv-conf", conf]
    # The fault: after step 3 the worker whose agent does not host the rendezvous store kills that agent.
    job = tmp_path / "elastic"
    _run(job, elastic, "agent:3", agents=2, rdzv_port=port)
    assert len(_starts(job)) == 2, f"started {len(_starts(job))} times, expected 2"
    assert sorted(_losses(job)) == list(range(1, STEPS + 1))
    got, want = _final(job), _final(ref)
    for name, value in want.items():
        err = (got[name] - value).abs().max().item()
        assert err <= 1e-6, f"parameter {name}: W=2 -> W=1 after losing an agent differs by {err:.2e}"
