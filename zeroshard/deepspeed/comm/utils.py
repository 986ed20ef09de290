"""``deepspeed.comm.utils``: this process's place in the job, as the launcher's environment says.

Read as DeepSpeed reads them: the torch-style variable first (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``: the
DeepSpeed launcher, ``torchrun`` and ``zeroshard launch`` set them), then Open MPI's
(``OMPI_COMM_WORLD_*``), else a single-process job (rank 0 of 1). A variable that is set but not an integer
raises ``ValueError``. Nothing here needs a process group.
"""

from __future__ import annotations

import os

from zeroshard.deepspeed import surface

__all__ = ["get_local_rank_from_launcher", "get_world_rank_from_launcher", "get_world_size_from_launcher"]


def _from_environment(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return int(value)
    return default


def get_local_rank_from_launcher() -> int:
    """This process's index on its node: ``LOCAL_RANK``, else ``OMPI_COMM_WORLD_LOCAL_RANK``, else 0."""
    return _from_environment(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher() -> int:
    """This process's rank in the job: ``RANK``, else ``OMPI_COMM_WORLD_RANK``, else 0."""
    return _from_environment(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """The number of processes in the job: ``WORLD_SIZE``, else ``OMPI_COMM_WORLD_SIZE``, else 1."""
    return _from_environment(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
