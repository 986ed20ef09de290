"""``deepspeed.init_distributed`` with DeepSpeed's signature, over :func:`zeroshard.init_distributed`."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

from zeroshard.core.comm import DEFAULT_TIMEOUT
from zeroshard.dist import init_distributed as _join
from zeroshard.dist import require_process_group, validate_rank

logger = logging.getLogger(__name__)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group (DeepSpeed's signature), over :func:`zeroshard.init_distributed`.

    ``init_method``, ``rank``, ``world_size`` and ``timeout`` go to ``torch.distributed.init_process_group``
    as DeepSpeed passes them, so ``init_distributed("gloo", init_method="file:///tmp/rdv", rank=r,
    world_size=w)`` joins without any launcher variable; by default the launcher's (torchrun,
    ``zeroshard launch``) ``env://`` variables describe the group. ``rank`` and ``world_size`` (when >= 0) and
    ``distributed_port`` also fill in ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` where they are unset, so code that reads them later finds them. ``auto_mpi_discovery``,
    ``verbose`` and ``config`` are accepted and have no effect (zeroshard reads no MPI environment).
    ``dist_init_required=False`` joins nothing and requires a group already initialized, as DeepSpeed's
    asserts. A group already initialized is reused.

    Raises:
        ValueError: ``rank`` or ``world_size`` out of range, or a backend other than gloo and nccl.
        UsageError: ``dist_init_required=False`` without an initialized group (an ``AssertionError`` too).
    """
    if dist_init_required is False:
        require_process_group("init_distributed", launched_only=False)
        return
    validate_rank(rank, world_size)
    if rank >= 0 and world_size >= 0:
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(world_size))
        os.environ.setdefault("LOCAL_RANK", str(rank))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "WORLD_SIZE" in os.environ:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    _join(
        dist_backend=dist_backend, timeout=timeout, init_method=init_method, rank=rank, world_size=world_size
    )
