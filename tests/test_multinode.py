"""Two nodes on one machine train as one node does, and their checkpoint resumes on one node.

Each "node" is a torchrun agent (started by ``zeroshard launch`` or by plain torchrun) with two processes;
the two agents meet at 127.0.0.1 as two machines would meet at node 0's address. The training script
(tests/integration_scripts/multinode_train.py) trains the same tiny model at stages 1, 2 and 3 in one job
and checks that every rank knows its node from its launcher (``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``): on one machine the host names cannot tell the nodes apart.

The jobs: one node at W=4; two ``zeroshard launch`` agents; two plain torchrun agents with the static
rendezvous (``--master-addr``/``--master-port``) and with the c10d one (``--rdzv-endpoint``). All four
run the same ranks on the same data, so their per-step losses and final parameters must agree within
1e-6 (fp32); on one machine they are in fact bit-identical, which the test prints (``pytest -s``). The
``zeroshard launch`` two-node job saves a checkpoint after step 2; one node at W=2 resumes it and trains to
step 4, and must agree with the W=4 job within 1e-6 (a different world size sums in another order).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integration_scripts" / "multinode_train.py"
STAGES = (1, 2, 3)
STEPS = 4
SAVE_AT = 2
TOLERANCE = 1e-6
JOB_TIMEOUT = 420.0  # one job, all three stages; the CPU may be shared with other test runs
PORT_TRIES = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # torchrun sets these for its workers; none may come from an outer launcher
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # plain torchrun runs with its defaults
    return env


def _zeroshard(flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli", "launch", *flags, str(SCRIPT)]


def _torchrun(flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags, str(SCRIPT)]


def _script_args(job: Path, local_world_size: int, group_rank: int, *extra: str) -> list[str]:
    """The training script's arguments: results into ``job``/out, the node variables each rank must see
    (``group_rank`` -1: the c10d rendezvous numbers the nodes itself)."""
    return [
        *("--out", str(job / "out"), "--steps", str(STEPS), "--stages", *map(str, STAGES)),
        *("--local-world-size", str(local_world_size), "--group-rank", str(group_rank), *extra),
    ]


def _run(job: Path, commands: list[list[str]]) -> None:
    """Run ``commands`` (the agents of one job) together until all exit 0, or fail the test with their
    output: at once when one fails (its peers are killed), or after JOB_TIMEOUT seconds."""
    (job / "out").mkdir(parents=True)
    logs = [job / f"agent{i}.log" for i in range(len(commands))]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with open(log, "wb") as out:  # a file, not a pipe: no one reads a pipe while we wait
                procs.append(
                    subprocess.Popen(
                        command, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip
        failure = _wait_all(procs)
    finally:
        for proc in procs:  # also on a pytest-timeout interrupt: no agent or worker outlives the test
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if failure:
        output = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-6000:]}" for log in logs)
        raise AssertionError(f"{job.name}: {failure}\n{output}")


def _wait_all(procs: list[subprocess.Popen[bytes]]) -> str:
    """'' once every process has exited 0; otherwise what went wrong (a nonzero exit, or the time)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    running = list(procs)
    while running:
        if time.monotonic() > deadline:
            return f"agents {[procs.index(p) for p in running]} still running after {JOB_TIMEOUT} s"
        for proc in list(running):
            try:
                code = proc.wait(timeout=1.0)  # bounded, so that a peer's failure is seen within a second
            except subprocess.TimeoutExpired:
                continue
            running.remove(proc)
            if code != 0:
                return f"agent {procs.index(proc)} exited with {code}"
    return ""


def _run_two_nodes(job: Path, commands: Callable[[int], list[list[str]]]) -> None:
    """Run the two agents ``commands(port)`` gives, node 0 hosting the rendezvous at ``port``. The port is
    free when the OS hands it out, but another process may take it before node 0 binds it: then, and only
    then, try again with another one."""
    for attempt in range(PORT_TRIES):
        try:
            _run(job, commands(_free_port()))
            return
        except AssertionError as error:
            taken = any(m in str(error).lower() for m in ("address already in use", "eaddrinuse"))
            if attempt == PORT_TRIES - 1 or not taken:
                raise
            shutil.rmtree(job)


def _result(job: Path, stage: int) -> dict[str, Any]:
    return torch.load(job / "out" / f"stage{stage}.pt")  # type: ignore[no-any-return]


def _difference(got: dict[str, Any], want: dict[str, Any], what: str) -> float:
    """The largest absolute difference between two results' losses and parameters (the same steps and
    parameter names are required)."""
    assert sorted(got["losses"]) == sorted(want["losses"]), f"{what}: steps {sorted(got['losses'])}"
    assert got["params"].keys() == want["params"].keys(), f"{what}: parameter names differ"
    diffs = [abs(got["losses"][s] - want["losses"][s]) for s in want["losses"]]
    diffs += [(got["params"][n] - p).abs().max().item() for n, p in want["params"].items()]
    return float(max(diffs))


def _identical(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return got["losses"] == want["losses"] and all(
        torch.equal(got["params"][n], p) for n, p in want["params"].items()
    )


def _static(node: int, port: int) -> list[str]:
    """Launcher flags of node ``node`` of two, static rendezvous at node 0's address (both torchrun's and
    zeroshard launch's spelling)."""
    return [
        *("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2"),
        *("--master-addr", "127.0.0.1", "--master-port", str(port)),
    ]


def _c10d(port: int) -> list[str]:
    """torchrun flags of either node of two, c10d rendezvous (the first agent to start hosts its store)."""
    return [
        *("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "multinode"),
    ]


@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_two_nodes_train_as_one_and_their_checkpoint_resumes_on_one_node(tmp_path: Path) -> None:
    one, two, static, c10d, resumed = (
        tmp_path / name for name in ("one-node", "two-zeroshard", "two-static", "two-c10d", "resumed")
    )
    ckpt = two / "ckpt"
    _run(one, [_zeroshard(["--nproc-per-node", "4"]) + _script_args(one, 4, 0)])
    save = ("--save", str(ckpt), "--save-at", str(SAVE_AT))
    _run_two_nodes(
        two, lambda port: [_zeroshard(_static(n, port)) + _script_args(two, 2, n, *save) for n in (0, 1)]
    )
    _run_two_nodes(
        static, lambda port: [_torchrun(_static(n, port)) + _script_args(static, 2, n) for n in (0, 1)]
    )
    _run_two_nodes(c10d, lambda port: [_torchrun(_c10d(port)) + _script_args(c10d, 2, -1) for _ in (0, 1)])
    resume = _script_args(resumed, 2, 0, "--resume", str(ckpt))
    _run(resumed, [_zeroshard(["--nproc-per-node", "2"]) + resume])

    report = []
    for stage in STAGES:
        want = _result(one, stage)
        assert want["start"] == 0 and sorted(want["losses"]) == list(range(1, STEPS + 1)), want["losses"]
        for what, job in (
            ("two zeroshard launch agents", two),
            ("two torchrun agents, static rendezvous", static),
            ("two torchrun agents, c10d rendezvous", c10d),
        ):
            what = f"stage {stage}, {what} vs one node (W=4)"
            got = _result(job, stage)
            diff = _difference(got, want, what)
            assert diff <= TOLERANCE, f"{what}: losses or parameters differ by {diff:.3g}"
            equal = "bit-identical" if _identical(got, want) else "not bit-identical"
            report.append(f"{what}: largest difference {diff:.3g}, {equal}")
        # The W=4 job's steps after the checkpoint, continued at W=2 from the two-node job's checkpoint.
        got = _result(resumed, stage)
        what = f"stage {stage}, two-node checkpoint of step {SAVE_AT} resumed at W=2 vs W=4 continued"
        assert got["start"] == SAVE_AT, f"{what}: started from step {got['start']}"
        later = {"losses": {s: v for s, v in want["losses"].items() if s > SAVE_AT}, "params": want["params"]}
        diff = _difference(got, later, what)
        assert diff <= TOLERANCE, f"{what}: losses or parameters differ by {diff:.3g}"
        report.append(f"{what}: largest difference {diff:.3g}")
    print("\n".join(report))
