"""Stage 3 with hpZ (ZeRO++'s hierarchical partitioning): later gathers from node-local secondary shards.

[Note: hpZ secondary shards]
With ``zero_optimization.zero_hpz_partition_size`` H (core/hybrid.py [Note: hpZ groups]) a unit keeps its
primary shard over all W ranks, and the forward gathers it from there as in plain ZeRO-3. A unit the
forward gathers also keeps this rank's *secondary shard*: its slice ``j`` of H of the full flat buffer in the
compute dtype, ``j`` being the rank's place in its hpZ group. Every later gather of a unit that has one
(in the backward: the before-backward hooks, recomputations under activation checkpointing, prefetches; in
the forward: a unit used again after it was released, such as an embedding tied to the output layer)
all-gathers the H secondary shards over the hpZ group instead of the W primary ones: the same values (the
forward's first gather wrote them), so the results are bit-identical to plain ZeRO-3's, and with H the
ranks per node nothing of it crosses a node. DeepSpeed's hpZ uses the secondary shards in the backward
only; a forward's second gather of a unit moves the same values either way, and inside the node costs
less. The secondary shard stays valid across the micro-steps of an accumulation; it is dropped
whenever the master shards change (``FlatUnit.master_to_full``, which every step and every checkpoint load
run, and ``FlatUnit.full_to_master``, after parameters changed by hand), so the next forward's gather makes
a new one. Creating, using and dropping it happen at the same point on every rank (the same modules run,
the same steps are taken), so every rank of an hpZ group picks the same group for each gather.

Memory: ``padded / H`` elements in the compute dtype per unit while its secondary shard lives, from the
first forward after a step to the next step; ``FlatUnit.bytes_held`` counts them as parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.stage3.phase import Phase

__all__ = ["GatherSource"]


class GatherSource:
    """Which group gathers a unit: ``hpz`` (the secondary shards over the hpZ group, unquantized) where hpZ
    is on and the unit has a secondary shard, else ``gather`` (the primary shards over every rank, in int8
    with ``quantized``)."""

    def __init__(self, gather: Comm, hpz: Comm | None, *, quantized: bool = False) -> None:
        self.gather = gather
        self.hpz = hpz
        self.quantized = quantized  # the primary gathers in int8: quantize.py [Note: quantized collectives]

    def start(self, unit: FlatUnit, *, exact: bool = False) -> None:
        """Launch ``unit``'s gather from its source. ``exact`` (a gather whose values a user reads or writes
        back into the masters: ``GatheredParameters``, state dicts): the primary shards, never in int8.
        Collective: all ranks of the chosen group, same units."""
        if exact:
            unit.start_gather(self.gather)
        elif self.hpz is not None and unit.secondary is not None:
            unit.start_gather(self.hpz, from_secondary=True)
        else:
            unit.start_gather(self.gather, quantized=self.quantized)

    def check_exact(self, units: Iterable[FlatUnit], write_back: bool) -> None:
        """With ``write_back``, refuse before the block units that could not be written back exactly
        (``FlatUnit.check_write_back``). Local; the same on every rank."""
        for unit in units if write_back else ():
            unit.check_write_back()

    def keep(self, units: Iterable[FlatUnit], phase: Phase) -> None:
        """``units`` were gathered for a module's forward: each keeps its secondary shard (hpZ only)."""
        if self.hpz is None or phase.in_backward:
            return
        for unit in units:
            unit.keep_secondary(self.hpz.rank, self.hpz.world_size)
