"""Where a unit's shards live between uses: the :class:`ShardStore` protocol and the in-memory store.

[Note: shard stores]
A unit does not know where its shards live. It holds a :class:`ShardStore` and goes through it for the
four things that depend on it: this rank's parameter shard (what a stage-3 gather reads, and when that
read is done), stepped master values to write into the parameters (:meth:`ShardStore.master_to_full`),
parameter values changed by hand to take into the master (:meth:`ShardStore.full_to_master`), and the
tensors the optimizer steps. :class:`InMemoryShards`, the default, keeps them in the unit's own buffers:
the master, or this rank's slice of the full buffer. The offload stores (``zeroshard/offload/unit_store.py``)
keep the master in an NVMe file between steps and, with ``offload_param``, the parameter shard as well; the
offload set-up hands one to a unit as it is built. Beside a GPU, ``zeroshard/offload/host_shards.py`` keeps
the master, and with ``offload_param`` the parameter shard, in CPU memory ([Note: offload beside a
device]).

A store reads its unit through :class:`UnitBuffers`, the few buffers it needs, so this module does not
import the unit's class (``flat_param.FlatUnit``, which imports this one).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from zeroshard.core.stages import StagePlan


class UnitBuffers(Protocol):
    """What a store reads of the unit it belongs to (``flat_param.FlatUnit`` is one)."""

    master: torch.Tensor
    """This rank's master shard (an empty placeholder while an offload store keeps it elsewhere)."""

    @property
    def plan(self) -> StagePlan:
        """The unit's stage plan: whether its parameters are sharded between uses."""
        ...

    def own_full_shard(self) -> torch.Tensor:
        """This rank's slice of the unit's full buffer (empty while a stage-3 unit is released)."""
        ...


UnitT = TypeVar("UnitT", contravariant=True)


class ShardStore(Protocol[UnitT]):
    """One unit's shards between uses ([Note: shard stores]). Every method takes the unit it belongs to,
    of type ``UnitT`` (an offload store may need more of it than :class:`UnitBuffers`)."""

    @property
    def prefetches(self) -> bool:
        """Whether :meth:`prefetch` starts anything (the gatherer reads ahead only for such stores)."""
        ...

    def param_shard(self, unit: UnitT) -> torch.Tensor:
        """This rank's shard of the parameters as stored between uses: what a stage-3 gather reads."""
        ...

    def prefetch(self, unit: UnitT) -> None:
        """Start bringing :meth:`param_shard` into memory ahead of a gather."""
        ...

    def gathered(self, unit: UnitT) -> None:
        """The gather that read :meth:`param_shard` is done: an in-memory copy read for it may go."""
        ...

    def master_to_full(self, unit: UnitT, values: torch.Tensor | None = None, start: int = 0) -> None:
        """Write stepped master values into the parameters as stored, cast to their dtype: ``values`` for
        shard elements ``start:start + numel`` (stepped outside the unit), or with ``values=None`` the
        unit's whole in-memory ``master`` (stepped in place)."""
        ...

    def full_to_master(self, unit: UnitT, full_shard: torch.Tensor) -> None:
        """This rank's slice of the full parameters, ``full_shard``, was changed in place: make it the
        master's value."""
        ...

    def master_piece(self, unit: UnitT, start: int, numel: int) -> torch.Tensor:
        """The tensor the optimizer steps for master elements ``start:start + numel``."""
        ...

    def held_param_shard(self) -> torch.Tensor | None:
        """A parameter shard the store keeps in memory besides the unit's buffers, if any (for the memory
        accounting)."""
        ...

    def flush(self) -> None:
        """Make the writes of :meth:`master_to_full` visible to the computation (a store that copies them
        to the device asynchronously waits for the copies here); the step calls it before the parameters
        are used again."""
        ...


class InMemoryShards:
    """The default store: the master and the parameters live in the unit's own buffers."""

    prefetches = False

    def param_shard(self, unit: UnitBuffers) -> torch.Tensor:
        return unit.master if unit.plan.shard_parameters else unit.own_full_shard()

    def prefetch(self, unit: UnitBuffers) -> None:
        return None

    def gathered(self, unit: UnitBuffers) -> None:
        return None

    def master_to_full(self, unit: UnitBuffers, values: torch.Tensor | None = None, start: int = 0) -> None:
        # The parameters' shard is the master itself at stage 3 (the next gather reads it) and, in fp32 at
        # stages 0-2, the master is the full buffer's slice: then there is nothing to copy.
        source = unit.master if values is None else values
        target = self.param_shard(unit)[start : start + source.numel()]
        if target.data_ptr() != source.data_ptr():
            target.copy_(source)

    def full_to_master(self, unit: UnitBuffers, full_shard: torch.Tensor) -> None:
        if full_shard.data_ptr() != unit.master.data_ptr():
            unit.master.copy_(full_shard)

    def master_piece(self, unit: UnitBuffers, start: int, numel: int) -> torch.Tensor:
        return unit.master[start : start + numel]

    def held_param_shard(self) -> torch.Tensor | None:
        return None

    def flush(self) -> None:
        return None
