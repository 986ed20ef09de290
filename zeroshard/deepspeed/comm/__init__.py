"""``deepspeed.comm``: DeepSpeed's communication names over ``torch.distributed``.

The collectives are torch's own functions under DeepSpeed's names (same arguments: ``tensor``, ``op``,
``group``, ``async_op``); nothing here reimplements them. The queries answer for one process (rank 0 of 1)
when no process group is initialized, as DeepSpeed's do after ``init_distributed`` in a single process.
``init_distributed`` is ``deepspeed.init_distributed``.
"""

from __future__ import annotations

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
    "destroy_process_group",
    "gather",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "init_distributed",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
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

    Comm(group).barrier(what="deepspeed.comm.barrier")
    return None


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    dist.destroy_process_group(group)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
