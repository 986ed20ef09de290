"""`zeroshard launch`: start a training script on this node's processes, through torchrun.

Each process runs the script through `zeroshard.cli.worker`: `import deepspeed` gives `zeroshard.deepspeed`
there, and the script gets `--local_rank=N` (as with DeepSpeed's launcher; `--no_local_rank` turns it off).

A thin layer over `torch.distributed.run` (torchrun): it works out torchrun's arguments from flags, a
DeepSpeed hostfile or the Slurm environment, then replaces itself with `python -m torch.distributed.run`.
It never starts processes on other machines: on several nodes, run it once on each (with `srun`, `pdsh`,
your scheduler, or by hand; `--dry-run` prints each node's command).

How this node's place is decided, first match wins:

1. `--hostfile F`: the nodes are F's hosts (after `--include` / `--exclude`), node 0's address is the
   master address, this node is the host whose name matches this machine's (or `--node-rank`), and it
   runs one process per selected slot (CUDA_VISIBLE_DEVICES names them when not all are selected).
2. `--nnodes N` with `--node-rank`, `--master-addr` and `--master-port`: as given.
3. Inside a Slurm job: SLURM_JOB_NUM_NODES, SLURM_NODEID and the job's first node (see `hosts.py`).
4. Otherwise one node: torchrun `--standalone`, which picks a free port itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zeroshard.cli.hosts import read_hostfile, select_slots, slurm_topology

__all__ = ["LaunchPlan", "plan_launch", "register"]

logger = logging.getLogger(__name__)

DEFAULT_MASTER_PORT = 29500


# Variables torchrun and the workers get unless the environment sets them. By default torchrun's agents hand
# their rendezvous TCPStore to the workers' process group; with two agents (`--nnodes 2`) a rank then
# sometimes aborted at exit, after its group was destroyed ("terminate called without an active exception":
# 1 run in 6 to 8 with the CPU busy, none in 10 with the store not shared). A store of the workers' own
# avoids it.
WORKER_DEFAULTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class LaunchPlan:
    """What to run on this node: torchrun's arguments and the variables to add to the environment."""

    torchrun_args: list[str]
    """Arguments of `python -m torch.distributed.run`, the script and its arguments included."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables set for torchrun and its workers (CUDA_VISIBLE_DEVICES with --include / --exclude)."""
    node_commands: dict[str, tuple[dict[str, str], list[str]]] = field(default_factory=dict)
    """With a hostfile, every node's `(env, torchrun_args)`, by host (for --dry-run)."""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args]


def _local_names() -> set[str]:
    host = socket.gethostname()
    names = {host, host.split(".")[0], socket.getfqdn(), "localhost", "127.0.0.1"}
    try:
        names.add(socket.gethostbyname(host))
    except OSError:
        pass  # a hostname that does not resolve still matches by name
    return names


def _default_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _node_args(nnodes: int, node_rank: int, nproc: int, master_addr: str, master_port: int) -> list[str]:
    return [
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        master_addr,
        "--master-port",
        str(master_port),
    ]


def _script_args(args: argparse.Namespace) -> list[str]:
    # Each rank runs zeroshard.cli.worker, which makes `import deepspeed` give zeroshard.deepspeed and adds
    # --local_rank=N (unless --no_local_rank) before running the script, as DeepSpeed's launcher does.
    worker = ["--module", "zeroshard.cli.worker", *(["--as-module"] if args.module else [])]
    worker += ["--no-local-rank"] if args.no_local_rank else []
    # Last of torchrun's own options: restarts resume through the job's checkpoints (docs/reliability.md).
    restarts = ["--max-restarts", str(args.max_restarts)] if args.max_restarts else []
    return [*restarts, *worker, args.script, *args.script_args]


def _from_hostfile(args: argparse.Namespace, local_names: set[str]) -> LaunchPlan:
    if args.nnodes is not None:
        raise ValueError("--hostfile and --nnodes cannot be used together: the hostfile lists the nodes")
    hosts = read_hostfile(args.hostfile)
    slots = select_slots(hosts, args.include, args.exclude)
    names = list(slots)
    if args.node_rank is not None:
        if not 0 <= args.node_rank < len(names):
            raise ValueError(
                f"--node-rank {args.node_rank} is not in 0..{len(names) - 1} ({len(names)} hosts selected)"
            )
        node_rank = args.node_rank
    else:
        matches = [i for i, name in enumerate(names) if name in local_names]
        if len(matches) != 1:
            found = "is not among" if not matches else "matches several of"
            raise ValueError(
                f"this machine ({socket.gethostname()}) {found} the selected hosts of {args.hostfile} "
                f"({', '.join(names)}); run zeroshard launch on one of them, or pass --node-rank"
            )
        node_rank = matches[0]
    master = args.master_addr or names[0]
    port = args.master_port or DEFAULT_MASTER_PORT
    script = _script_args(args)
    commands = {
        name: (
            _visible_devices(slots[name], hosts[name]),
            _node_args(len(names), rank, len(slots[name]), master, port) + script,
        )
        for rank, name in enumerate(names)
    }
    mine = names[node_rank]
    if args.nproc_per_node is not None and args.nproc_per_node != len(slots[mine]):
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node} contradicts the hostfile: {mine} has {len(slots[mine])} "
            "selected slots; leave --nproc-per-node out or change slots="
        )
    return LaunchPlan(commands[mine][1], commands[mine][0], commands)


def _visible_devices(selected: list[int], count: int) -> dict[str, str]:
    # Only when a subset is selected: otherwise the user's own CUDA_VISIBLE_DEVICES stays in force.
    if selected == list(range(count)):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(s) for s in selected)}


def plan_launch(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    local_names: set[str] | None = None,
    gpu_count: Callable[[], int] = _default_gpu_count,
) -> LaunchPlan:
    """Works out torchrun's arguments for this node (see the module docstring for the order of sources).

    Args:
        args: The parsed `zeroshard launch` arguments.
        env: The environment (Slurm variables are read from it).
        local_names: Names and addresses of this machine, to find it in a hostfile (default: looked up).
        gpu_count: How many GPUs this node has, for the default number of processes.

    Raises:
        ValueError: When the flags contradict each other or a hostfile, spec or Slurm variable is wrong.
    """
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ValueError(
            f"--nproc-per-node {args.nproc_per_node} is not allowed; expected a whole number >= 1"
        )
    if args.hostfile:
        return _from_hostfile(args, _local_names() if local_names is None else local_names)
    if args.include or args.exclude:
        # Without a hostfile DeepSpeed selects among this machine's GPUs, named "localhost".
        count = args.nproc_per_node or gpu_count() or 1
        slots = select_slots({"localhost": count}, args.include, args.exclude)["localhost"]
        plan = plan_launch(
            _replace(args, include=None, exclude=None, nproc_per_node=len(slots)),
            env,
            local_names=local_names,
            gpu_count=gpu_count,
        )
        return LaunchPlan(plan.torchrun_args, {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))})
    slurm = None if args.no_slurm or args.nnodes is not None else slurm_topology(env)
    nproc = args.nproc_per_node or (slurm.gpus_on_node if slurm else None) or gpu_count() or 1
    nnodes = args.nnodes if args.nnodes is not None else (slurm.nnodes if slurm else 1)
    if nnodes < 1:
        raise ValueError(f"--nnodes {nnodes} is not allowed; expected a whole number >= 1")
    explicit = [args.node_rank is not None, args.master_addr is not None, args.master_port is not None]
    if nnodes == 1 and not any(explicit):
        return LaunchPlan(["--standalone", "--nproc-per-node", str(nproc), *_script_args(args)])
    node_rank = args.node_rank if args.node_rank is not None else (slurm.node_rank if slurm else None)
    master = args.master_addr or (slurm.master_addr if slurm else None)
    port = args.master_port or (slurm.master_port if slurm else DEFAULT_MASTER_PORT)
    if nnodes > 1 and (node_rank is None or master is None):
        raise ValueError(
            f"--nnodes {nnodes} needs --node-rank (this node's index) and --master-addr (node 0's address), "
            "or a --hostfile, or a Slurm job"
        )
    node_rank = node_rank or 0
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} is not in 0..{nnodes - 1} (--nnodes {nnodes})")
    return LaunchPlan(_node_args(nnodes, node_rank, nproc, master or "127.0.0.1", port) + _script_args(args))


def _replace(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def _run(args: argparse.Namespace) -> int:
    try:
        plan = plan_launch(args, os.environ)
    except ValueError as err:
        print(f"zeroshard launch: error: {err}", file=sys.stderr)
        return 1
    if args.dry_run:
        for host, (env, node_args) in (
            plan.node_commands or {"this node": (plan.env, plan.torchrun_args)}
        ).items():
            print(f"# {host}\n{_shell(env, [sys.executable, '-m', 'torch.distributed.run', *node_args])}")
        return 0
    command = plan.command()
    print(f"zeroshard launch: {_shell(plan.env, command)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # torchrun replaces this process: signals reach it directly and its exit status is the command's.
    os.execve(sys.executable, command, {**WORKER_DEFAULTS, **os.environ, **plan.env})
    return 0  # not reached


def _shell(env: Mapping[str, str], command: list[str]) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command)])


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is not allowed; expected a whole number >= 0")
    return value


def register(subparsers: Any) -> None:
    """Adds `zeroshard launch` to `subparsers`."""
    parser = subparsers.add_parser(
        "launch",
        help="run a training script on this node's processes (through torchrun)",
        description="Runs SCRIPT in --nproc-per-node processes through torchrun (torch.distributed.run). "
        "Several nodes: give --nnodes/--node-rank/--master-addr, or a DeepSpeed --hostfile, or run inside a "
        "Slurm job, and run the command once on every node.",
    )
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        "--num_gpus",
        "--num-gpus",
        type=int,
        default=None,
        help="processes on this node (default: hostfile slots, Slurm GPUs, CUDA GPUs, else 1)",
    )
    parser.add_argument("--nnodes", "--num_nodes", type=int, default=None, help="number of nodes")
    parser.add_argument(
        "--node-rank", "--node_rank", type=int, default=None, help="this node's index, 0..nnodes-1"
    )
    parser.add_argument("--master-addr", "--master_addr", default=None, help="address of node 0")
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help=f"rendezvous port on node 0 (default {DEFAULT_MASTER_PORT})",
    )
    parser.add_argument(
        "--hostfile", "-H", default=None, help="DeepSpeed hostfile: lines of 'hostname slots=N'"
    )
    parser.add_argument("--include", "-i", default=None, help="only these hosts/slots, e.g. host1:0,1@host2")
    parser.add_argument("--exclude", "-e", default=None, help="all but these hosts/slots, e.g. host1:0@host2")
    parser.add_argument("--no-slurm", action="store_true", help="ignore the Slurm environment")
    parser.add_argument(
        "--module", "-m", action="store_true", help="SCRIPT is a module name (python -m SCRIPT)"
    )
    parser.add_argument(
        "--no-local-rank",
        "--no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (DeepSpeed's launcher passes it, and so does this)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=_non_negative,
        default=0,
        help="restart the processes of every node up to N times after a failure (torchrun's --max-restarts)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the torchrun command of each node and exit"
    )
    parser.add_argument("script", help="the training script (or module, with --module)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the training script")
    parser.set_defaults(func=_run)
