"""Parameters that ``zero.Init`` keeps partitioned until ``initialize`` takes them: their full shape and
size, and their full values gathered back.

Each ``zero.Init`` context (``zeroshard/zero.py``) keeps a ``ParameterMap`` from each parameter it cut to
(full shape, this rank's shard, the group's ``Comm``) and lists it here with :func:`track` ([Note: parameter
owners] in owners.py). ``build_units`` (units.py) sizes units with :func:`full_numel` and takes the
parameters with :func:`materialize`; ``GatheredParameters`` reads :func:`partition_entry`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from zeroshard.core.comm import Comm
from zeroshard.core.ds_attrs import withdraw
from zeroshard.core.owners import OwnerRegistry, ParameterMap

# The full shape, this rank's slice of the flattened parameter, and the group's Comm.
Partition = tuple[torch.Size, torch.Tensor, Comm]
# The parameter maps of the Init contexts that still hold partitioned parameters ([Note: parameter owners]).
_INITS: OwnerRegistry[Partition] = OwnerRegistry(weak=False)


def track(partitioned: ParameterMap[Partition]) -> None:
    """List an ``Init`` context's map (again after adding to it: an empty map is dropped)."""
    _INITS.add(partitioned)


def partition_entry(param: nn.Parameter) -> Partition | None:
    return _INITS.find(param)


def _take_partition(param: nn.Parameter) -> Partition | None:
    """Remove ``param`` from the ``Init`` context that partitioned it; its entry, or ``None``."""
    for partitioned in _INITS.live():
        entry = partitioned.pop(param)
        if entry is not None:
            return entry
    return None


def full_value(shape: torch.Size, shard: torch.Tensor, comm: Comm, device: torch.device) -> torch.Tensor:
    """The full value of an ``Init``-partitioned parameter. Collective: all ranks of ``comm``."""
    shard = shard.to(device)
    full = torch.empty(comm.world_size * shard.numel(), dtype=shard.dtype, device=shard.device)
    comm.all_gather(full, shard, what="zero.Init parameter gather").wait()
    return full[: shape.numel()].view(shape).clone()


def full_shape(param: nn.Parameter) -> torch.Size:
    """The parameter's shape, also while ``Init`` keeps it partitioned."""
    entry = partition_entry(param)
    return param.shape if entry is None else entry[0]


def full_numel(param: nn.Parameter) -> int:
    """The parameter's element count, also while ``Init`` keeps it partitioned."""
    entry = partition_entry(param)
    return param.numel() if entry is None else entry[0].numel()


def materialize(params: Iterable[nn.Parameter], comm: Comm) -> None:
    """Give ``Init``-partitioned ``params`` their full values again (one all-gather each).

    Collective: call on all ranks with the same parameters, in the same order.
    """
    for param in params:
        entry = _take_partition(param)
        if entry is None:
            continue
        shape, shard, built = entry
        if built.world_size != comm.world_size:
            raise RuntimeError(
                f"rank {comm.rank}: a parameter was partitioned by zeroshard.zero.Init over "
                f"{built.world_size} ranks but initialize() runs on {comm.world_size}: build the model with "
                "the same process group"
            )
        # initialize() may have moved the placeholder to the training device: gather there.
        param.data = full_value(shape, shard, comm, param.device)
        withdraw(param)  # the engine holds it now: [Note: DeepSpeed parameter attributes]
