"""ZeRO-Infinity for the optimizer: master shards and optimizer state in an NVMe file between steps.

[Note: sub-group stepping]
This rank's shard of each unit is cut into sub-groups of at most ``sub_group_size`` elements at parameter
piece boundaries (a piece larger than that is a sub-group of its own; a sub-group never spans two units).
Between steps a sub-group's separate master (see unit_store.py [Note: offloaded master]) and every optimizer
state tensor with one value per element (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's momentum, ...) live
only in the store; scalar state (``step``) stays in memory. One optimizer step is, per sub-group k::

    read k+1   |  step k (its slices get their gradients, the others None)  |  write k-1

so the reads and writes of the neighbours overlap the step of group k, and at most three sub-groups are
in memory. Calling ``optimizer.step()`` once per sub-group gives the same values as one call over all
slices: torch skips parameters whose ``.grad`` is None, and every supported optimizer is elementwise.

While a sub-group is resident its slices' masters point (``.data``) at the read buffer and its state
entries are views of the read buffers; afterwards both are empty placeholders again. Anything that reads
the optimizer's state or the masters outside a step (checkpoints, exports) runs inside :meth:`resident`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.layout import Piece
from zeroshard.offload.malloc import keep_large_blocks_mapped, release_free_memory
from zeroshard.offload.nvme import NvmeStore
from zeroshard.offload.unit_store import OffloadedMaster

logger = logging.getLogger(__name__)

StateKind = tuple[str, torch.dtype]


@dataclass
class SubGroup:
    """Consecutive pieces of one unit's shard, stepped (and swapped) together."""

    index: int
    unit: FlatUnit
    pieces: list[Piece]  # this rank's pieces of the unit's parameters, in shard order
    start: int  # shard offset of the first piece
    numel: int
    offload_master: bool
    slices: list[OptimizerSlice] = field(default_factory=list)
    # Per-element optimizer state kinds held in the store, and which slices have state there.
    kinds: list[StateKind] = field(default_factory=list)
    stateful: set[int] = field(default_factory=set)  # indices into slices

    def key(self, what: str) -> str:
        return f"g{self.index}.{what}"


@dataclass
class _Resident:
    """The buffers a resident sub-group is stepped in."""

    master: torch.Tensor | None
    state: dict[str, torch.Tensor]
    reads: list[Future[None]]


def split_sub_groups(unit: FlatUnit, sub_group_size: int, first_index: int) -> list[SubGroup]:
    """Cut ``unit``'s shard into sub-groups at piece boundaries (see [Note: sub-group stepping])."""
    groups: list[SubGroup] = []
    current: list[Piece] = []
    start = size = 0
    for piece in unit.layout.pieces(unit.rank):
        if current and size + piece.numel > max(1, sub_group_size):
            groups.append(_group(first_index + len(groups), unit, current, start, size))
            current, size = [], 0
        if not current:
            start = piece.shard_start
        current.append(piece)
        size += piece.numel
    if current:
        groups.append(_group(first_index + len(groups), unit, current, start, size))
    return groups


def attach_slices(groups: Sequence[SubGroup], slices: Sequence[OptimizerSlice]) -> None:
    """Give each sub-group the optimizer's slices of its pieces (slices of parameters in no optimizer
    group stay out)."""
    by_piece = {(sl.unit.index, sl.piece.index): sl for sl in slices}
    for g in groups:
        keys = [(g.unit.index, piece.index) for piece in g.pieces]
        g.slices = [by_piece[k] for k in keys if k in by_piece]


def _group(index: int, unit: FlatUnit, pieces: list[Piece], start: int, numel: int) -> SubGroup:
    return SubGroup(index, unit, list(pieces), start, numel, offload_master=unit.separate_master)


def _per_element(value: object, numel: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dim() == 1
        and value.numel() == numel
    )


class OptimizerStateSwapper:
    """Keeps masters and per-element optimizer state of this rank's sub-groups in an :class:`NvmeStore`.

    Life cycle: :meth:`adopt` each unit as it is built (its master goes to the store at once, so a model
    built with ``zero.Init`` never holds all masters in memory), :meth:`bind` the optimizer's slices, then
    :meth:`step` once per optimizer step. Local: no collectives.
    """

    def __init__(self, store: NvmeStore, sub_group_size: int) -> None:
        keep_large_blocks_mapped()
        self.store = store
        self.sub_group_size = sub_group_size
        self.groups: list[SubGroup] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._placeholders: dict[torch.dtype, torch.Tensor] = {}
        self.stores: dict[int, OffloadedMaster] = {}  # by unit index: the units whose master is here
        # Writes in flight, one list per sub-group, each with the buffer it reads from (kept alive here).
        self._writes: list[list[tuple[Future[None], torch.Tensor]]] = []
        self.io_wait_s = 0.0  # time the step spent waiting for the store (not hidden behind compute)

    # -- set-up --------------------------------------------------------------------------------------
    def adopt(self, unit: FlatUnit) -> list[SubGroup]:
        """Cut ``unit`` into sub-groups and move its separate master (if any) to the store."""
        groups = split_sub_groups(unit, self.sub_group_size, len(self.groups))
        self.groups.extend(groups)
        if not unit.separate_master:
            return groups  # fp32 stages 0-2: the master is the parameters' own shard and stays with them
        store = OffloadedMaster(unit, unit.master)
        master = unit.move_master(store)
        self.stores[unit.index] = store
        self.store.write_ranges(master, [(g.key("master"), g.start, g.numel) for g in groups])
        return groups

    def bind(self, slices: Sequence[OptimizerSlice], optimizer: torch.optim.Optimizer) -> None:
        """Attach the optimizer's slices to their sub-groups (slices of parameters in no group stay out)."""
        self.optimizer = optimizer
        attach_slices(self.groups, slices)

    # -- one optimizer step ----------------------------------------------------------------------------
    def step(self, grads: dict[int, torch.Tensor | None], factor: float = 1.0) -> None:
        """Step every sub-group with ``grads`` (keyed by ``id`` of a slice's master; None or absent skips).

        Each gradient is cast to the master's dtype and multiplied by ``factor`` (unscale and clip) as
        its sub-group is stepped: the same operations the in-memory step applies to all at once.

        Pipelined as in [Note: sub-group stepping]; the stepped masters are written into the parameters
        (``FlatUnit.master_to_full``). Sub-groups with no gradient anywhere are not read at all.
        """
        opt = self._require_optimizer()
        work = [
            g
            for g in self.groups
            if self._stale(g.unit) or any(grads.get(id(sl.master)) is not None for sl in g.slices)
        ]
        ahead = [self._swap_in(work[0])] if work else []
        for k, g in enumerate(work):
            current = ahead.pop()
            if k + 1 < len(work):
                ahead.append(self._swap_in(work[k + 1]))  # read k+1 during step k
            self._bind_resident(g, current)
            stepped = False
            for sl in g.slices:
                grad = grads.get(id(sl.master))
                if grad is not None:
                    grad = grad.to(device=sl.master.device, dtype=sl.master.dtype)
                    grad = grad * factor if factor != 1.0 else grad
                sl.master.grad = grad
                stepped = stepped or grad is not None
            if stepped:
                opt.step()
            for sl in g.slices:
                sl.master.grad = None
            self._swap_out(g, current)  # write k while k+1 steps
        self._drain()
        for g in work:  # every stale unit's sub-groups were in the work list
            self._refreshed(g.unit)
        release_free_memory()

    def grad_partials(self, unit: FlatUnit) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None: the step's checks read the gradient shards in memory (``OffloadedStep``)."""
        return None

    @contextlib.contextmanager
    def resident(self, write_back: bool) -> Iterator[None]:
        """Every sub-group in memory inside the block (``unit.master`` real again); with ``write_back`` the
        masters and optimizer state are written to the store on exit (after a checkpoint load).

        Peak memory is the whole offloaded state of this rank for the duration.
        """
        self._require_optimizer()
        units = {id(g.unit): g.unit for g in self.groups if g.offload_master}
        masters = {
            uid: torch.empty(unit.layout.shard_size, dtype=unit.master.dtype) for uid, unit in units.items()
        }
        residents = [(g, self._swap_in(g, masters.get(id(g.unit)))) for g in self.groups]
        for g, res in residents:
            self._bind_resident(g, res)
        for uid, unit in units.items():
            unit.master = masters[uid]
        try:
            yield
        finally:
            for unit in units.values():
                unit.master = self._placeholder(unit.master.dtype)
            for g, res in residents:
                if write_back:
                    self._swap_out(g, res)
                else:
                    self._unbind(g)
            self._drain()
            for unit in units.values():
                self._refreshed(unit)

    def _stale(self, unit: FlatUnit) -> bool:
        store = self.stores.get(unit.index)
        return store is not None and store.stale

    def _refreshed(self, unit: FlatUnit) -> None:
        store = self.stores.get(unit.index)
        if store is not None:
            store.stale = False

    def offloaded_bytes(self) -> int:
        """Bytes of masters and optimizer state this rank keeps in the store between steps."""
        total = 0
        for g in self.groups:
            per_element = sum(dtype.itemsize for _, dtype in g.kinds)
            per_element += g.unit.master.element_size() if g.offload_master else 0
            total += g.numel * per_element
        return total

    def close(self) -> None:
        self._drain()
        self.store.close()

    # -- swapping ----------------------------------------------------------------------------------------
    def _swap_in(self, g: SubGroup, unit_master: torch.Tensor | None = None) -> _Resident:
        """Start reading ``g``'s master and state into fresh buffers."""
        reads: list[Future[None]] = []
        master = None
        if g.offload_master:
            if unit_master is not None:
                master = unit_master[g.start : g.start + g.numel]
            else:
                master = self.store.empty(g.numel, g.unit.master.dtype)
            reads.append(self.store.read(g.key("master"), master))
        state = {}
        for name, dtype in g.kinds:
            state[name] = self.store.empty(g.numel, dtype)
            reads.append(self.store.read(g.key(name), state[name]))
        return _Resident(master, state, reads)

    def _bind_resident(self, g: SubGroup, res: _Resident) -> None:
        """Wait for ``res``'s reads and point ``g``'s slices and state entries at the buffers."""
        self._wait(res.reads)
        res.reads = []
        opt = self._require_optimizer()
        unit = g.unit
        if res.master is not None and self._stale(unit):
            source = unit.param_shard[g.start : g.start + g.numel]
            res.master.copy_(source)  # the parameters were changed by hand: see [Note: offloaded master]
        for i, sl in enumerate(g.slices):
            lo = sl.piece.shard_start - g.start
            if res.master is not None:
                sl.master.data = res.master[lo : lo + sl.piece.numel]
            if i in g.stateful:
                entry = opt.state[sl.master]
                for name, buf in res.state.items():
                    entry[name] = buf[lo : lo + sl.piece.numel]

    def _swap_out(self, g: SubGroup, res: _Resident) -> None:
        """Copy the (possibly new) state into ``res``'s buffers, write master and state, drop the views."""
        opt = self._require_optimizer()
        kinds = dict(g.kinds)
        for i, sl in enumerate(g.slices):
            for name, value in opt.state.get(sl.master, {}).items():
                if _per_element(value, sl.piece.numel):
                    kinds.setdefault(name, value.dtype)
                    g.stateful.add(i)
        g.kinds = list(kinds.items())
        for name, dtype in g.kinds:
            buf = res.state.get(name)
            if buf is None or buf.dtype != dtype:
                buf = res.state[name] = self.store.empty(g.numel, dtype)
                buf.zero_()
            for i in g.stateful:
                sl = g.slices[i]
                value = opt.state[sl.master][name]
                lo = sl.piece.shard_start - g.start
                view = buf[lo : lo + sl.piece.numel]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value)
        writes = []
        if res.master is not None:
            g.unit.master_to_full(res.master, g.start)
            writes.append((self.store.write(g.key("master"), res.master), res.master))
        for name, buf in res.state.items():
            writes.append((self.store.write(g.key(name), buf), buf))
        self._unbind(g)
        # Group k's writes overlap the step of k+1; those of k-1 must be done by then (bounded memory).
        while self._writes:
            self._wait([f for f, _ in self._writes.pop(0)])
        self._writes.append(writes)

    def _unbind(self, g: SubGroup) -> None:
        opt = self._require_optimizer()
        for i, sl in enumerate(g.slices):
            if g.offload_master:
                sl.master.data = self._placeholder(sl.master.dtype)
            if i in g.stateful:
                entry = opt.state[sl.master]
                for name, dtype in g.kinds:
                    entry[name] = self._placeholder(dtype)

    def _drain(self) -> None:
        pending, self._writes = self._writes, []
        self._wait([f for writes in pending for f, _ in writes])

    def _wait(self, futures: list[Future[None]]) -> None:
        start = time.perf_counter()
        for f in futures:
            f.result()
        self.io_wait_s += time.perf_counter() - start

    def _placeholder(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._placeholders:
            self._placeholders[dtype] = torch.empty(0, dtype=dtype)
        return self._placeholders[dtype]

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("the optimizer-state swapper has no optimizer: bind() it first")
        return self.optimizer
