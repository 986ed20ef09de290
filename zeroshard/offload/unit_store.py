"""The shard store of a unit whose master lives in the optimizer swapper's NVMe file.

[Note: offloaded master]
With the optimizer offloaded to NVMe (``swapper.py``) a unit's separate master lives in a file between
steps: the unit's ``master`` is an empty placeholder (the swapper points it at real memory while a
checkpoint needs it resident), and at stage 3 a compute-dtype copy of this rank's shard stays in memory
for gathers to read. With ``offload_param.device: nvme`` that copy lives in a file too
(``param_swap.py``, [Note: parameter shards on NVMe]). The parameters are the truth a stale master is
re-derived from: values changed by hand only mark the master ``stale``, and the swapper refreshes it from
the parameter shard when it next reads it. The unit sees none of this: it holds an
:class:`OffloadedMaster` as its :class:`~zeroshard.core.shard_store.ShardStore` ([Note: shard stores]).
"""

from __future__ import annotations

from typing import Protocol

import torch

from zeroshard.core.flat_param import FlatUnit


class ShardHome(Protocol):
    """Where a unit's parameter shard lives between uses when it is not in memory (``offload_param`` nvme).

    Implementations (``param_swap.ParamShardStore``) must return from :meth:`load` exactly what
    :meth:`store_range` last wrote.
    """

    def load(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's parameter shard of ``unit``, read back (waits for a prefetch in flight)."""
        ...

    def prefetch(self, unit: FlatUnit) -> None:
        """Start reading ``unit``'s shard so that a later :meth:`load` finds it ready."""
        ...

    def drop(self, unit: FlatUnit) -> None:
        """Forget a loaded copy of ``unit``'s shard (the stored bytes stay)."""
        ...

    def store_range(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        """Write ``values`` over ``unit``'s stored shard from element ``start`` on."""
        ...


class OffloadedMaster:
    """A unit's shards with its master in an NVMe file ([Note: offloaded master]).

    Attributes:
        stale: the parameters were changed by hand since the master was last written: the swapper
            re-derives the master from :meth:`param_shard` before it next steps or reads it.
    """

    def __init__(self, unit: FlatUnit, master: torch.Tensor) -> None:
        self.stale = False
        self._home: ShardHome | None = None
        # At stage 3 gathers read a compute-dtype copy of the shard; at stages 0-2 the full buffer holds it.
        self._param_shard: torch.Tensor | None = None
        if unit.plan.shard_parameters:
            same = master.dtype == unit.policy.compute and master.device == unit.device
            self._param_shard = master if same else master.to(unit.device, unit.policy.compute)

    def move_home(self, home: ShardHome) -> None:
        """The parameter shard now lives in ``home`` (already written there): forget the in-memory copy."""
        self._home = home
        self._param_shard = None

    @property
    def prefetches(self) -> bool:
        return self._home is not None

    def param_shard(self, unit: FlatUnit) -> torch.Tensor:
        if self._param_shard is not None:
            return self._param_shard
        if self._home is not None:
            return self._home.load(unit)
        return unit.own_full_shard()

    def prefetch(self, unit: FlatUnit) -> None:
        if self._home is not None:
            self._home.prefetch(unit)

    def gathered(self, unit: FlatUnit) -> None:
        if self._home is not None:
            self._home.drop(unit)

    def master_to_full(self, unit: FlatUnit, values: torch.Tensor | None = None, start: int = 0) -> None:
        if values is None:
            # Stepped in place: only a master made resident for a checkpoint load
            # (OptimizerStateSwapper.resident) is in memory. At stages 0-2 it goes into the full buffer as an
            # in-memory one does; at stage 3 the swapper writes it here, as a range, when the block ends.
            if unit.master.numel() and not unit.plan.shard_parameters:
                unit.own_full_shard().copy_(unit.master)
            return
        if self._home is not None:
            self._home.store_range(unit, start, values)
        else:
            self.param_shard(unit)[start : start + values.numel()].copy_(values)

    def full_to_master(self, unit: FlatUnit, full_shard: torch.Tensor) -> None:
        if self._home is not None:
            self._home.store_range(unit, 0, full_shard)
        elif self._param_shard is not None:
            self._param_shard.copy_(full_shard)
        self.stale = True

    def master_piece(self, unit: FlatUnit, start: int, numel: int) -> torch.Tensor:
        # A placeholder of its own per slice: the swapper points it at real storage while resident.
        return torch.empty(0, dtype=unit.master.dtype)

    def held_param_shard(self) -> torch.Tensor | None:
        return self._param_shard

    def flush(self) -> None:
        return None
