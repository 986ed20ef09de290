"""`zeroshard launch`: hostfiles, include/exclude, Slurm, torchrun arguments, one real 2-process run."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import pytest

from zeroshard.cli.hosts import expand_nodelist, parse_host_spec, parse_hostfile, select_slots, slurm_topology
from zeroshard.cli.launch import LaunchPlan, plan_launch
from zeroshard.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


# -- hostfile ------------------------------------------------------------------------------------------------


def test_hostfile_reads_hosts_in_order_with_comments_and_blank_lines() -> None:
    text = "# cluster\n\nworker-1 slots=8   # the first node\n  worker-2 slots=4\n\n10.0.0.3 slots=2\n"
    assert parse_hostfile(text) == {"worker-1": 8, "worker-2": 4, "10.0.0.3": 2}
    assert list(parse_hostfile(text)) == ["worker-1", "worker-2", "10.0.0.3"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a slots=2\na slots=4\n", "hostfile hf, line 2: host 'a' is already listed on line 1"),
        ("a slots=2\nb\n", "hostfile hf, line 2: 'b' is not 'hostname slots=N'"),
        ("a slots=two\n", "hostfile hf, line 1: slots='two' is not allowed; expected a whole number >= 1"),
        ("a slots=0\n", "line 1: slots='0' is not allowed"),
        ("a slots=-1\n", "line 1: slots='-1' is not allowed"),
        ("\n\na gpus=2\n", "hostfile hf, line 3: 'a gpus=2' is not 'hostname slots=N'"),
        ("a slots=2 extra\n", "line 1: 'a slots=2 extra' is not 'hostname slots=N'"),
        ("a/b slots=2\n", "line 1: 'a/b' is not a host name"),
        ("# only comments\n\n", "hostfile hf: no hosts"),
    ],
)
def test_hostfile_errors_name_the_line_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_hostfile(text, source="hostfile hf")
    assert message in str(err.value)


# -- include / exclude ---------------------------------------------------------------------------------------

HOSTS = {"a": 4, "b": 2, "c": 2}


def test_host_spec_parses_hosts_and_slots() -> None:
    assert parse_host_spec("a:0,2@b") == {"a": [0, 2], "b": None}
    with pytest.raises(ValueError, match="slots 'x' of 'a' are not whole numbers"):
        parse_host_spec("a:x")
    with pytest.raises(ValueError, match="host 'a' appears twice"):
        parse_host_spec("a@a:1")
    with pytest.raises(ValueError, match="empty host"):
        parse_host_spec("a@")


def test_include_keeps_only_the_listed_hosts_and_slots() -> None:
    assert select_slots(HOSTS, include="a:1,3@c") == {"a": [1, 3], "c": [0, 1]}
    assert select_slots(HOSTS) == {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0, 1]}


def test_exclude_removes_slots_or_whole_hosts() -> None:
    assert select_slots(HOSTS, exclude="a:0@b") == {"a": [1, 2, 3], "c": [0, 1]}
    assert select_slots(HOSTS, exclude="c:0,1") == {"a": [0, 1, 2, 3], "b": [0, 1]}


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("a", "b", "--include and --exclude cannot be used together"),
        ("z", None, "--include: host 'z' is not in the hostfile (hosts: a, b, c)"),
        (None, "b:2", "--exclude: 'b' has no slot 2 (slots=2, so 0..1)"),
        (None, "a@b@c", "--exclude 'a@b@c' leaves no slot to run on"),
    ],
)
def test_include_exclude_errors(include: str | None, exclude: str | None, message: str) -> None:
    with pytest.raises(ValueError) as err:
        select_slots(HOSTS, include, exclude)
    assert message in str(err.value)


# -- Slurm ---------------------------------------------------------------------------------------------------


def test_slurm_nodelist_expansion() -> None:
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("n[8-10]") == ["n8", "n9", "n10"]
    assert expand_nodelist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    with pytest.raises(ValueError, match="unbalanced"):
        expand_nodelist("gpu[01-02")
    with pytest.raises(ValueError, match="bad range 'a-b'"):
        expand_nodelist("gpu[a-b]")


SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[07-10]",
    "SLURM_GPUS_ON_NODE": "8",
}


def test_slurm_topology_from_the_environment() -> None:
    topo = slurm_topology(SLURM)
    assert topo is not None
    assert (topo.nnodes, topo.node_rank, topo.master_addr, topo.gpus_on_node) == (4, 2, "gpu07", 8)
    assert topo.master_port == 29500 + 123456 % 10000
    assert slurm_topology({"PATH": "/bin"}) is None
    legacy = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "a,b"}
    topo = slurm_topology(legacy)
    assert topo is not None and (topo.nnodes, topo.master_addr, topo.gpus_on_node) == (2, "a", None)


def test_slurm_errors_name_the_variable() -> None:
    with pytest.raises(ValueError, match="SLURM_NODEID is not set"):
        slurm_topology({k: v for k, v in SLURM.items() if k != "SLURM_NODEID"})
    with pytest.raises(ValueError, match=r"SLURM_NODEID\(5\) >= SLURM_JOB_NUM_NODES\(4\)"):
        slurm_topology({**SLURM, "SLURM_NODEID": "5"})


# -- the torchrun arguments ----------------------------------------------------------------------------------


def plan(
    argv: list[str], env: dict[str, str] | None = None, gpus: int = 0, names: set[str] | None = None
) -> LaunchPlan:
    args = build_parser().parse_args(["launch", *argv])
    return plan_launch(args, env or {}, local_names=names or {"localhost"}, gpu_count=lambda: gpus)


SCRIPT = ["train.py", "--steps", "2", "--deepspeed_config", "ds.json"]
WORKER = ["--module", "zeroshard.cli.worker"]  # each rank runs the script through it


def test_single_node_is_standalone_and_passes_the_script_arguments_through() -> None:
    assert plan(["--nproc-per-node", "2", *SCRIPT]).torchrun_args == [
        "--standalone",
        "--nproc-per-node",
        "2",
        *WORKER,
        *SCRIPT,
    ]
    assert plan(["--no_local_rank", *SCRIPT]).torchrun_args[3:] == [*WORKER, "--no-local-rank", *SCRIPT]
    # Default process count: the GPUs, else 1.
    assert plan(SCRIPT, gpus=4).torchrun_args[:3] == ["--standalone", "--nproc-per-node", "4"]
    assert plan(SCRIPT).torchrun_args[:3] == ["--standalone", "--nproc-per-node", "1"]
    assert plan(["-m", "pkg.train", "--x"]).torchrun_args[-5:] == [*WORKER, "--as-module", "pkg.train", "--x"]
    # DeepSpeed's spellings of the flags are accepted too.
    assert plan(["--nproc_per_node", "3", *SCRIPT]).torchrun_args[:3] == [
        "--standalone",
        "--nproc-per-node",
        "3",
    ]
    assert plan(["--num_gpus", "3", *SCRIPT]).torchrun_args[:3] == ["--standalone", "--nproc-per-node", "3"]
    # Restarts go to torchrun, before the worker (tests/test_restarts.py shows what a restart resumes).
    assert plan(["--max-restarts", "2", *SCRIPT]).torchrun_args[3:] == [
        "--max-restarts",
        "2",
        *WORKER,
        *SCRIPT,
    ]
    multi = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "--max_restarts", "1", *SCRIPT]
    assert plan(multi).torchrun_args[10:] == ["--max-restarts", "1", *WORKER, *SCRIPT]


def test_multi_node_flags_go_to_torchrun() -> None:
    got = plan(
        [
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29555",
            *SCRIPT,
        ]
    )
    assert got.torchrun_args == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29555",
        *WORKER,
        *SCRIPT,
    ]
    assert got.env == {}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--nnodes", "2", "--node-rank", "0"],
            "--nnodes 2 needs --node-rank (this node's index) and --master-addr",
        ),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
            "--node-rank 2 is not in 0..1 (--nnodes 2)",
        ),
        (["--nproc-per-node", "0"], "--nproc-per-node 0 is not allowed"),
        (["--nnodes", "0"], "--nnodes 0 is not allowed"),
    ],
)
def test_multi_node_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as err:
        plan([*argv, *SCRIPT])
    assert message in str(err.value)


def test_slurm_gives_nodes_rank_master_and_gpus() -> None:
    got = plan(SCRIPT, env=SLURM).torchrun_args
    port = str(29500 + 123456 % 10000)
    assert got == [
        "--nnodes",
        "4",
        "--node-rank",
        "2",
        "--nproc-per-node",
        "8",
        "--master-addr",
        "gpu07",
        "--master-port",
        port,
        *WORKER,
        *SCRIPT,
    ]
    # Flags win over Slurm; --no-slurm ignores it; a one-node job is standalone.
    assert plan(["--master-port", "1234", *SCRIPT], env=SLURM).torchrun_args[9] == "1234"
    assert plan(["--no-slurm", *SCRIPT], env=SLURM).torchrun_args[0] == "--standalone"
    one = {**SLURM, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    assert plan(SCRIPT, env=one).torchrun_args[:3] == ["--standalone", "--nproc-per-node", "8"]


def test_hostfile_finds_this_node_and_selects_gpus(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=4\nnode-b slots=4\n")
    got = plan(["--hostfile", str(hostfile), *SCRIPT], names={"node-b", "localhost"})
    assert got.torchrun_args == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "4",
        "--master-addr",
        "node-a",
        "--master-port",
        "29500",
        *WORKER,
        *SCRIPT,
    ]
    assert got.env == {}
    assert set(got.node_commands) == {"node-a", "node-b"}
    # Selecting slots sets CUDA_VISIBLE_DEVICES and the process count of each node.
    got = plan(["-H", str(hostfile), "--include", "node-a:1,3@node-b", *SCRIPT], names={"node-a"})
    assert got.env == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert got.torchrun_args[:6] == ["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2"]
    assert got.node_commands["node-b"][0] == {}
    # Excluding a whole node leaves a one-node job whose master is the remaining host.
    got = plan(["-H", str(hostfile), "--exclude", "node-a", *SCRIPT], names={"node-b"})
    assert got.torchrun_args[:4] == ["--nnodes", "1", "--node-rank", "0"]
    assert got.torchrun_args[7] == "node-b"


def test_hostfile_errors(tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    with pytest.raises(ValueError, match=r"is not among the selected hosts .*node-a, node-b.*--node-rank"):
        plan(["-H", str(hostfile), *SCRIPT], names={"elsewhere"})
    assert (
        plan(["-H", str(hostfile), "--node-rank", "1", *SCRIPT], names={"elsewhere"}).torchrun_args[3] == "1"
    )
    with pytest.raises(ValueError, match="--hostfile and --nnodes cannot be used together"):
        plan(["-H", str(hostfile), "--nnodes", "2", *SCRIPT])
    with pytest.raises(ValueError, match="--nproc-per-node 3 contradicts the hostfile: node-a has 2"):
        plan(["-H", str(hostfile), "--nproc-per-node", "3", *SCRIPT], names={"node-a"})
    with pytest.raises(ValueError, match="cannot read hostfile"):
        plan(["-H", str(tmp_path / "missing"), *SCRIPT])


def test_include_without_hostfile_selects_local_gpus() -> None:
    got = plan(["--include", "localhost:1,2", *SCRIPT], gpus=4)
    assert got.env == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert got.torchrun_args[:3] == ["--standalone", "--nproc-per-node", "2"]


def test_errors_exit_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "hostfile"
    bad.write_text("node-a slots=2\nnode-a slots=2\n")
    assert main(["launch", "--hostfile", str(bad), "train.py"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"zeroshard launch: error: hostfile {bad}, line 2: host 'node-a' is already listed")
    assert "Traceback" not in err


def test_dry_run_prints_every_node_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\nnode-b slots=2\n")
    assert main(["launch", "-H", str(hostfile), "--exclude", "localhost:1", "--dry-run", "t.py", "--x"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# localhost"
    assert out[1].startswith("CUDA_VISIBLE_DEVICES=0 ") and out[1].endswith(
        "-m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr localhost "
        "--master-port 29500 --module zeroshard.cli.worker t.py --x"
    )
    assert out[2] == "# node-b" and "--node-rank 1 --nproc-per-node 2" in out[3]


# -- end to end ----------------------------------------------------------------------------------------------


EXAMPLE = ["examples/train_gpt.py", "--steps", "2", "--deepspeed_config", "examples/configs/zero1.json"]


@dataclasses.dataclass
class _Launched:
    """A `zeroshard launch` command running, its output going to a file (a pipe no one reads while the test
    waits for another node could fill, block the writer, and hang the job at its shutdown barrier)."""

    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


def _launch(argv: list[str]) -> _Launched:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "zeroshard.cli", "launch", *argv, *EXAMPLE]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return _Launched(proc, log)


def _finish(launched: list[_Launched], timeout: float) -> list[str]:
    """Every command's output once all have exited 0 within ``timeout`` seconds (together); otherwise an
    AssertionError with the output of each, and the commands still running are killed."""
    deadline = time.monotonic() + timeout
    try:
        for each in launched:
            try:
                each.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"not done after {timeout} s:\n"
                    + "\n---\n".join(other.output()[-4000:] for other in launched)
                ) from None
            assert each.proc.returncode == 0, each.output()
        return [each.output() for each in launched]
    finally:
        for each in launched:
            if each.proc.poll() is None:
                each.proc.kill()
                each.proc.wait()
            each.log.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch_node(rank: int, port: str) -> _Launched:
    return _launch(
        [
            *("--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank)),
            *("--master-addr", "127.0.0.1", "--master-port", port),
        ]
    )


@pytest.mark.integration
def test_launch_one_node_and_two_nodes_train_the_same() -> None:
    (single,) = _finish([_launch(["--nproc-per-node", "2"])], timeout=240)
    assert "world size 2" in single
    final = [line for line in single.splitlines() if "after 2 optimizer steps" in line]
    assert len(final) == 1, single
    # Two "nodes" on this machine: two launch commands, one process each, meeting at node 0's address.
    # The port is free when the OS hands it out but another process may take it before node 0 binds it:
    # then (and only then) try again with another one.
    for attempt in range(3):
        port = str(_free_port())
        nodes = [_launch_node(rank, port) for rank in (0, 1)]
        try:
            node0, _ = _finish(nodes, timeout=240)
            break
        except AssertionError as error:
            taken = any(m in str(error).lower() for m in ("address already in use", "eaddrinuse"))
            if attempt == 2 or not taken:
                raise
    # The same world size, ranks and seeds: the same losses, digit for digit.
    assert [line for line in node0.splitlines() if "after 2 optimizer steps" in line] == final
