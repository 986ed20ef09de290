"""One unit's shards between uses, and where they live.

[Note: shard stores]
A unit does not know where its shards live. It holds a :class:`ShardStore` and goes through it for the
four things that depend on it: this rank's parameter shard (what a stage-3 gather reads, and when that
read is done), stepped master values to write into the parameters, parameter values changed by hand to
take into the master, and the tensors the optimizer steps. :class:`InMemoryShards`, the default, keeps
them in the unit's own buffers: the master, or this rank's slice of the full buffer. The offload stores
(``zeroshard/offload/unit_store.py``) keep the master in an NVMe file between steps and, with
``offload_param``, the parameter shard as well; the offload set-up hands one to a unit as it is built.
With ``master_device`` (CPU offload beside a GPU) the master lives in CPU memory and the step runs there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from zeroshard.core.flat_param import FlatUnit


class ShardStore(Protocol):
    """One unit's shards between uses. Every method takes the unit it belongs to."""

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` starts anything (the gatherer reads ahead only for such stores)."""
        ...

    def param_shard(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's shard of the parameters as stored between uses: what a stage-3 gather reads."""
        ...

    def prefetch(self, unit: FlatUnit) -> None:
        """Start bringing :meth:`param_shard` into memory ahead of a gather."""
        ...

    def gathered(self, unit: FlatUnit) -> None:
        """The gather that read :meth:`param_shard` is done: an in-memory copy read for it may go."""
        ...

    def write_stepped(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        """Stepped master values for shard elements ``start:start + numel``: write them into the
        parameters as stored (``values`` is cast to their dtype)."""
        ...

    def master_stepped(self, unit: FlatUnit) -> None:
        """The optimizer stepped the unit's in-memory ``master``: write it into the parameters as stored."""
        ...

    def take_full(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        """This rank's slice of the full parameters was changed in place: make it the master's value."""
        ...

    def master_piece(self, unit: FlatUnit, start: int, numel: int) -> torch.Tensor:
        """The tensor the optimizer steps for master elements ``start:start + numel``."""
        ...

    def held_param_shard(self) -> torch.Tensor | None:
        """A parameter shard the store keeps in memory besides the unit's buffers, if any (for the memory
        accounting)."""
        ...


class InMemoryShards:
    """The default store: the master and the parameters live in the unit's own buffers."""

    prefetches = False

    def param_shard(self, unit: FlatUnit) -> torch.Tensor:
        return unit.master if unit.plan.shard_parameters else unit.own_full_shard()

    def prefetch(self, unit: FlatUnit) -> None:
        return None

    def gathered(self, unit: FlatUnit) -> None:
        return None

    def write_stepped(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        self.param_shard(unit)[start : start + values.numel()].copy_(values)

    def master_stepped(self, unit: FlatUnit) -> None:
        copy_master_into_full(unit)

    def take_full(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        if shard.data_ptr() != unit.master.data_ptr():
            unit.master.copy_(shard)

    def master_piece(self, unit: FlatUnit, start: int, numel: int) -> torch.Tensor:
        return unit.master[start : start + numel]

    def held_param_shard(self) -> torch.Tensor | None:
        return None


def copy_master_into_full(unit: FlatUnit) -> None:
    """Write ``unit``'s in-memory master into this rank's slice of its full buffer (a cast, if the dtypes
    differ). Nothing at stage 3, where the next gather reads the master itself."""
    if unit.plan.shard_parameters:
        return
    shard = unit.own_full_shard()
    if shard.data_ptr() != unit.master.data_ptr():
        shard.copy_(unit.master, non_blocking=unit.host_to_device)  # see start_gather
