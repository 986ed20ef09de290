"""Process-group set-up from torchrun's environment (never a launcher or transport of our own)."""

from __future__ import annotations

import atexit
import datetime
import functools
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.attempt_store import attempt_store, under_agent_store
from zeroshard.core.comm import DEFAULT_TIMEOUT, Comm
from zeroshard.errors import UsageError
from zeroshard.watchdog import heartbeat

logger = logging.getLogger(__name__)

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """NCCL when CUDA is usable, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def training_device(model: nn.Module, comm: Comm) -> torch.device:
    """The device ``initialize`` trains ``model`` on (DeepSpeed's rule: this process's accelerator).

    A model already on an accelerator stays there. A model on the CPU moves to ``cuda:LOCAL_RANK`` when
    the process group runs NCCL, or when there is no process group and CUDA is available; with gloo (or
    without CUDA) it stays on the CPU.
    """
    current = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    if current.type != "cpu":
        return current
    if comm.device.type == "cuda":
        return comm.device
    if not dist.is_initialized() and torch.cuda.is_available():
        return torch.device("cuda", local_rank())
    return current


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> bool:
    """Join the process group that torchrun (or Slurm, via its exported variables) describes, or the one
    that ``init_method`` with ``rank`` and ``world_size`` describes.

    Reuses a process group that is already initialized. Without a launcher (no ``WORLD_SIZE`` in the
    environment), no ``init_method`` and no ``world_size``, it does nothing and training runs as world
    size 1. On CUDA it also selects the device of ``LOCAL_RANK``.

    Args:
        dist_backend: "gloo" or "nccl"; default: NCCL on CUDA, gloo on CPU.
        timeout: how long any collective may wait before it raises.
        init_method: a rendezvous URL (``env://``, ``tcp://host:port``, ``file:///path``); default:
            torchrun's ``env://``.
        rank: this process's rank, passed on to ``torch.distributed.init_process_group``; -1: from the
            environment (``RANK``) or from ``init_method``.
        world_size: the number of processes, passed on likewise; -1: from ``WORLD_SIZE`` or ``init_method``.

    Returns:
        True when a process group is in use afterwards, False for world size 1 without one.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int.
        ValueError: ``rank`` or ``world_size`` out of range, or an unsupported backend.
        RuntimeError: ``env://`` (no ``init_method``) without the launcher variables it needs.
    """
    validate_rank(rank, world_size)
    if dist.is_initialized():
        _destroy_at_exit()
        return True
    if "WORLD_SIZE" not in os.environ and init_method is None and world_size < 0:
        return False
    given = {"RANK": rank >= 0, "WORLD_SIZE": world_size >= 0}
    missing = [v for v in _LAUNCHER_VARS if v not in os.environ and not given.get(v, False)]
    if missing and init_method is None:  # env:// reads them; a URL carries its own rendezvous
        raise RuntimeError(
            f"joining the process group through env:// needs {', '.join(missing)} in the environment: start "
            "the script with `torchrun --nproc_per_node N script.py` (or `zeroshard launch`), which sets "
            "all of them, or pass init_method= (tcp:// or file://) with rank= and world_size="
        )
    backend = dist_backend or default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"dist_backend {backend!r} is not supported; expected 'gloo' or 'nccl'")
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    _join(backend, init_method, timeout, rank, world_size)
    _destroy_at_exit()
    logger.info(
        "initialized %s process group: rank %d of %d", backend, dist.get_rank(), dist.get_world_size()
    )
    return True


def join_process_group(dist_init_required: bool | None) -> None:
    """What ``initialize(dist_init_required=...)`` does first: join the launcher's process group
    (:func:`init_distributed`), or with ``False`` require one already joined where a launcher started
    several processes (:func:`require_process_group`)."""
    if dist_init_required is False:
        require_process_group("initialize", launched_only=True)
    else:
        init_distributed()


def require_process_group(what: str, *, launched_only: bool) -> None:
    """``dist_init_required=False`` promises that the caller has joined the process group: refuse to go on
    without one, where each process would otherwise train alone as world size 1, silently apart from the
    others. ``launched_only``: only where a launcher started several processes (``WORLD_SIZE`` > 1), so that
    one process without a launcher still trains (zeroshard's own ``initialize``); otherwise always, as
    DeepSpeed's ``init_distributed`` asserts.

    Raises:
        UsageError: no process group is initialized (a ``RuntimeError`` and an ``AssertionError``).
    """
    if dist.is_initialized():
        return
    launched = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if launched_only and launched <= 1:
        return
    raise UsageError(
        f"{what}(dist_init_required=False): torch.distributed is not initialized"
        + (f" although WORLD_SIZE={launched}" if launched > 1 else "")
        + "; call torch.distributed.init_process_group (or deepspeed.init_distributed) first, or leave "
        "dist_init_required unset so that it joins the group itself"
    )


def _join(
    backend: str, init_method: str | None, timeout: datetime.timedelta, rank: int, world_size: int
) -> None:
    """``init_process_group``; a torchrun worker's group lives in a store of its attempt's own."""
    if init_method is None and under_agent_store():  # [Note: a store per attempt]
        rank = rank if rank >= 0 else int(os.environ["RANK"])
        world_size = world_size if world_size >= 0 else int(os.environ["WORLD_SIZE"])
        store = attempt_store(rank, world_size, timeout)
        dist.init_process_group(backend, store=store, timeout=timeout, rank=rank, world_size=world_size)
        return
    dist.init_process_group(
        backend=backend,
        init_method=init_method or "env://",
        timeout=timeout,
        rank=rank,
        world_size=world_size,
    )


@functools.cache
def _destroy_at_exit() -> None:
    """Register, once per process, the exit hook of [Note: destroy the group at exit]."""
    atexit.register(_destroy_if_healthy)


def _destroy_if_healthy() -> None:
    """At interpreter exit: destroy the default process group unless a collective failed or is in flight.

    [Note: destroy the group at exit]
    A process that exits with a gloo process group still alive aborts in torch 2.13's teardown with
    "terminate called without an active exception" (SIGABRT, so torchrun reports the worker failed) in most
    runs on this machine: the group's C++ threads outlive the interpreter. Plain torch does the same; torch's
    answer is that the script call ``destroy_process_group()``, which DeepSpeed scripts, the Hugging Face
    Trainer and Lightning's strategy do not. ``init_distributed`` (and so ``initialize``) therefore registers
    this hook, which destroys the group while the interpreter is still whole. Destroying is local for gloo
    and NCCL. It is skipped when this process's monitor records a failed or unfinished collective: the
    process is leaving on an error, and a destroy could wait on a peer that never answers (a hang is worse
    than the abort). A script that destroyed the group itself finds nothing to do here.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    monitor = heartbeat.monitor_for_world()
    if monitor.failed is not None or monitor.blocked is not None:
        return
    try:
        dist.destroy_process_group()
    except Exception as err:  # the interpreter is exiting: report, do not replace the exit status
        logger.warning("could not destroy the process group at exit: %s", err)


def validate_rank(rank: int, world_size: int) -> None:
    """Refuse a ``rank``/``world_size`` pair ``torch.distributed`` cannot use (-1 stands for "not given")."""
    values: tuple[tuple[str, object], ...] = (("rank", rank), ("world_size", world_size))
    for name, value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} is not allowed; expected an int >= 0, or -1 for unset")
        if value < -1:
            raise ValueError(f"{name}={value!r} is not allowed; expected an int >= 0, or -1 for unset")
    if world_size == 0 or 0 <= world_size <= rank:
        raise ValueError(
            f"rank={rank}, world_size={world_size} is not allowed; expected 0 <= rank < world_size"
        )


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the process groups. Collective: call on all ranks.

    Destroying a gloo group while a peer is still tearing down its side of the connection can abort
    the process at exit ("terminate called without an active exception"); the entry check (bounded by the
    collective timeout) makes every rank leave together, and names the ranks still in another collective
    API. The heartbeats stop first. Does nothing without a process group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    comm = Comm(monitor=heartbeat.monitor_for_world())
    with comm.monitor.api("shutdown"):
        comm.check_entry("shutdown", None)
        heartbeat.halt_all()  # no heartbeat reaches rank 0's store after the barrier, which closes it
        comm.barrier(what="shutdown barrier")
    heartbeat.stop_all()
    dist.destroy_process_group()


def node_layout(comm: Comm) -> tuple[int, ...]:
    """The node of each rank of ``comm``'s group (0, 1, ... in order of first appearance), from the
    launcher's variables: ``GROUP_RANK`` (torchrun's node rank), else ``RANK // LOCAL_WORLD_SIZE``
    (launchers place consecutive ranks on a node). Never guessed from host names: a single process, or a
    launch where some rank has neither variable, is one node. Feeds the cross-node byte count
    (core/traffic.py [Note: bytes across nodes]).

    Collective: call on all ranks of ``comm`` (one ``all_gather_object``).
    """
    if comm.world_size == 1:
        return (0,)
    mine = _launcher_node()
    everyone = comm.all_gather_object(mine, what="node layout")
    if any(node is None for node in everyone):
        return (0,) * comm.world_size
    order: dict[int, int] = {}
    return tuple(order.setdefault(node, len(order)) for node in everyone)


def _launcher_node() -> int | None:
    """This process's node from the launcher's variables, or None where they do not say."""
    found: dict[str, int] = {}
    for var in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "RANK"):
        raw = os.environ.get(var)
        if raw is None:
            continue
        try:
            found[var] = int(raw)
        except ValueError:
            raise ValueError(f"{var}={raw!r} in the environment is not an integer") from None
    if "GROUP_RANK" in found:
        return found["GROUP_RANK"]
    if found.get("LOCAL_WORLD_SIZE", 0) > 0 and "RANK" in found:
        return found["RANK"] // found["LOCAL_WORLD_SIZE"]
    return None
