"""``deepspeed.comm``: DeepSpeed's communication names over ``torch.distributed``.

The collectives are torch's own functions under DeepSpeed's names (same arguments: ``tensor``, ``op``,
``group``, ``async_op``); nothing here reimplements them. The queries answer for one process (rank 0 of 1)
when no process group is initialized, as DeepSpeed's do after ``init_distributed`` in a single process.
``init_distributed`` is ``deepspeed.init_distributed``.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import (
    P2POp,
    ProcessGroup,
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    batch_isend_irecv,
    broadcast,
    broadcast_object_list,
    gather,
    irecv,
    isend,
    monitored_barrier,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.distributed import init_distributed

__all__ = [
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "gather",
    "get_all_ranks_from_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
]


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    debug: str | None = None,
) -> Any:
    """``all_gather_into_tensor`` under DeepSpeed's name (``debug`` names the caller in DeepSpeed's comms
    log, which zeroshard does not keep). Collective: call on all ranks of ``group``."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    debug: str | None = None,
) -> Any:
    """``reduce_scatter_tensor`` under DeepSpeed's name and argument names (``prof`` and ``debug`` drive
    DeepSpeed's comms log). Collective: call on all ranks of ``group``."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of processes in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's index on its node: the launcher's ``LOCAL_RANK`` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: ProcessGroup | None = None, group_rank: int = 0) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_world_group() -> ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def barrier(
    group: ProcessGroup | None = None, async_op: bool = False, device_ids: list[int] | None = None
) -> object:
    """``torch.distributed.barrier`` (does nothing without a process group); a blocking one is bounded by
    ``ZEROSHARD_COLLECTIVE_TIMEOUT_S`` and fails as zeroshard's collectives do. Collective: all ranks."""
    if not is_initialized():
        return None
    if async_op or device_ids is not None:
        return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
    from zeroshard.core.comm import Comm
    from zeroshard.watchdog.heartbeat import monitor_for_world

    Comm(group, monitor=monitor_for_world()).barrier(what="deepspeed.comm.barrier")
    return None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    dist.destroy_process_group(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order.

    As DeepSpeed: ``None`` names no registered group and gives ``[]``; a process group must be
    initialized. The world group gives every rank (DeepSpeed's loop never ends there: torch maps any rank
    of the world group to itself).
    """
    if not is_initialized():
        raise RuntimeError(
            "deepspeed.comm.get_all_ranks_from_group: no process group; call init_distributed()"
        )
    if group is None:
        return []
    if group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    try:
        return dist.get_process_group_ranks(group)
    except KeyError:  # not a registered group: DeepSpeed's lookup fails at once and gives []
        return []


def inference_all_reduce(
    tensor: torch.Tensor,
    op: ReduceOp.RedOpType = ReduceOp.SUM,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "all_reduce",
    debug: str | None = None,
) -> Any:
    """A blocking ``all_reduce`` of ``tensor`` in place (``async_op``, ``prof``, ``log_name`` and ``debug``
    are DeepSpeed's and change nothing). Returns ``tensor`` when the group has one process, else what
    ``torch.distributed.all_reduce`` returns (``None``), as DeepSpeed's does.

    Collective: call on all ranks of ``group``.
    """
    if get_world_size(group) <= 1:
        return tensor
    return all_reduce(tensor, op=op, group=group, async_op=False)


@surface.accepted("configures DeepSpeed's comms logger only; zeroshard keeps no comms log")
def configure(
    deepspeed_config: Any = None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Does nothing: DeepSpeed's only effect is on its comms logger, which zeroshard does not keep."""


@surface.accepted("prints DeepSpeed's comms log, which zeroshard does not keep (nothing is recorded)")
def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict[str, Any] | None:
    """What DeepSpeed's gives when its comms logger recorded nothing: ``None``, or with ``return_dict`` the
    summary's shape with no operations in it. Not collective (DeepSpeed's barriers only order its prints).
    """
    if not return_dict:
        return None
    return {
        "summary": {},
        "straggler_analysis": {} if show_straggler else None,
        "metadata": {
            "world_size": get_world_size(),
            "rank": get_rank(),
            "timestamp": datetime.datetime.now().isoformat(),
        },
    }


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
