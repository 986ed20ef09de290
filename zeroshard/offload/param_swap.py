"""ZeRO-Infinity for stage-3 parameters: each unit's compute-dtype shard in an NVMe file between uses.

[Note: parameter shards on NVMe]
At stage 3 with the optimizer offloaded to NVMe, a unit's gathers read ``FlatUnit.param_shard``, this
rank's shard in the compute dtype (unit_store.py [Note: offloaded master]). With ``offload_param.device:
nvme`` that shard lives in a file as well, one region per optimizer sub-group, so that a stepped sub-group
is written straight from the step without reading the rest of the unit. A gather reads the shard (or
finds it already read: the gatherer reads ahead along the previous step's order, see
``core.stage3.gatherer.ParameterGatherer``), launches the all-gather and drops the shard again. Persistent
units (small modules kept full, stage 3's ``param_persistence_threshold``) stay in memory.

Local: no collectives. The caller never reads a region while its write is in flight: every read first
waits for the pending write of the same region.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from zeroshard.core.flat_param import FlatUnit
from zeroshard.offload.nvme import NvmeStore
from zeroshard.offload.swapper import SubGroup
from zeroshard.offload.unit_store import OffloadedMaster

_Region = tuple[str, int, int]  # key, shard start, numel

MAX_WRITES = 4
"""Parameter-shard writes in flight at most; the last ones finish while the next forward runs."""


class ParamShardStore:
    """The compute-dtype shards of stage-3 units, in an :class:`NvmeStore` between uses."""

    def __init__(self, store: NvmeStore) -> None:
        self.store = store
        self._regions: dict[int, list[_Region]] = {}
        self._dtype: dict[int, torch.dtype] = {}
        self._loaded: dict[int, tuple[torch.Tensor, list[Future[None]]]] = {}
        self._writing: dict[str, tuple[Future[None], torch.Tensor]] = {}
        self.io_wait_s = 0.0  # time gathers spent waiting for reads (not hidden by the read-ahead)

    def adopt(self, unit: FlatUnit, groups: Sequence[SubGroup], keeper: OffloadedMaster) -> None:
        """Write ``unit``'s parameter shard to the store and have ``keeper`` (the unit's store) drop it from
        memory."""
        shard = unit.param_shard
        self._regions[unit.index] = [(f"p{g.index}", g.start, g.numel) for g in groups]
        self._dtype[unit.index] = shard.dtype
        self.store.write_ranges(shard, self._regions[unit.index])
        keeper.move_home(self)

    def offloaded_bytes(self) -> int:
        """Bytes of parameter shards kept in the store."""
        return sum(
            numel * self._dtype[index].itemsize
            for index, regions in self._regions.items()
            for _, _, numel in regions
        )

    def prefetch(self, unit: FlatUnit) -> None:
        """Start reading ``unit``'s shard (no-op if it is read or on the way)."""
        if unit.index in self._loaded or unit.index not in self._regions:
            return
        buf = self.store.empty(unit.layout.shard_size, self._dtype[unit.index])
        reads = []
        for key, start, numel in self._regions[unit.index]:
            self._wait_write(key)
            reads.append(self.store.read(key, buf[start : start + numel]))
        self._loaded[unit.index] = (buf, reads)

    def load(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s shard in memory (read now unless prefetched); kept until :meth:`drop`."""
        self.prefetch(unit)
        buf, reads = self._loaded[unit.index]
        start = time.perf_counter()
        for f in reads:
            f.result()
        self.io_wait_s += time.perf_counter() - start
        reads.clear()
        return buf

    def drop(self, unit: FlatUnit) -> None:
        """Forget ``unit``'s in-memory shard (after its all-gather is done)."""
        self._loaded.pop(unit.index, None)

    def store_range(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        """Write new values for shard elements ``start:start + numel`` (whole regions only)."""
        end = start + values.numel()
        loaded = self._loaded.pop(unit.index, None)
        if loaded is not None:  # a read-ahead copy would be stale: finish its reads and forget it
            for f in loaded[1]:
                f.result()
        for key, lo, numel in self._regions[unit.index]:
            if lo + numel <= start or lo >= end:
                continue
            if lo < start or lo + numel > end:
                raise RuntimeError(
                    f"unit {unit.index}: a parameter-shard write of elements {start}:{end} covers region "
                    f"{key} ({lo}:{lo + numel}) only in part"
                )
            self._wait_write(key)
            part = self.store.empty(numel, self._dtype[unit.index])
            part.copy_(values[lo - start : lo - start + numel])
            self._writing[key] = (self.store.write(key, part), part)
            self._bound_writes()

    def _bound_writes(self) -> None:
        """Forget finished writes and keep at most ``MAX_WRITES`` in flight (each holds its buffer)."""
        for key in [k for k, (f, _) in self._writing.items() if f.done()]:
            self._wait_write(key)
        while len(self._writing) > MAX_WRITES:
            self._wait_write(next(iter(self._writing)))

    def synchronize(self) -> None:
        for key in list(self._writing):
            self._wait_write(key)

    def _wait_write(self, key: str) -> None:
        pending = self._writing.pop(key, None)
        if pending is not None:
            pending[0].result()
