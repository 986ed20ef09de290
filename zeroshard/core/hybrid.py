"""The groups a ZeRO engine communicates on: plain ZeRO's one group, or hybrid sharding's (DeepSpeed's MiCS)
shard and replica groups.

[Note: hybrid sharding]
With ``zero_optimization.mics_shard_size`` S (S divides W, 1 <= S < W) the W data-parallel ranks form W/S
*shard groups* of S consecutive ranks (``[g*S, (g+1)*S)``, DeepSpeed's MiCS layout, so that a shard group is
a node when S is the ranks per node) and S *replica groups*, of the ranks with the same rank within their
shard group. Everything ZeRO shards is sharded over the shard group as if it were the whole world: the
units' layouts (1/S of each unit per rank), the gradients' reduce-scatter, the all-gather after the step,
stage 3's parameter gathers (on a second group over the same ranks, ``ShardGroups.gather``). The shard
groups hold identical state, so hybrid sharding adds one collective: at the end of the backward of an
accumulation boundary, every rank all-reduces its reduced gradient shard (1/S of the gradients) over its
replica group, as DeepSpeed's MiCS does (``allreduce_mics_shard_grads``). Averaging divides by W, so the
replica sum of the shard groups' averages is the world's. The step's checks sum the squared gradient norm
over the shard group only (the replicas hold the same shards: it is the global norm) and which parameters
got a gradient over both groups (a parameter may get one on some ranks only). Stage 0 shards nothing, so
the key has no effect there. S = W, -1 or 0 is plain ZeRO: one group, no replica group, no extra
collective. Memory per rank is ZeRO's with S in place of W (memory.py [Note: ZeRO memory formulas]).

[Note: hpZ groups]
With ``zero_optimization.zero_hpz_partition_size`` H at stage 3 (ZeRO++'s hierarchical partitioning, 1 < H <
W, H divides W) the state stays sharded over all W ranks, and one more group per H consecutive ranks
(``[g*H, (g+1)*H)``, the shard groups' layout: a node when H is the ranks per node) carries the backward's
parameter gathers from node-local secondary shards (``stage3/secondary.py`` [Note: hpZ secondary shards]).
H = 0, 1 or >= W is plain ZeRO-3. DeepSpeed does not combine hpZ with MiCS, nor does zeroshard.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.layout import split_into_units

__all__ = [
    "ShardGroups",
    "all_reduce_grad_shards",
    "check_hpz_size",
    "check_shard_size",
    "hpz_group",
    "hpz_on",
    "shard_groups",
]


@dataclass(frozen=True)
class ShardGroups:
    """The groups of one engine ([Note: hybrid sharding]); all share ``world``'s byte counts.

    Attributes:
        world: every data-parallel rank: agreements, checkpoints, the data loader.
        shard: the ranks one shard of the state is spread over (``world`` itself in plain ZeRO).
        replica: the ranks holding the same shard (None in plain ZeRO).
        gather: stage 3's parameter gathers, over the shard group's ranks (None below stage 3).
        hpz: stage 3's backward gathers from secondary shards ([Note: hpZ groups]; None when off).
    """

    world: Comm
    shard: Comm
    replica: Comm | None = None
    gather: Comm | None = None
    hpz: Comm | None = None

    @property
    def hybrid(self) -> bool:
        return self.replica is not None

    @property
    def replica_index(self) -> int:
        """Which shard group this rank is in (0 in plain ZeRO): checkpoints are written by group 0."""
        return self.world.rank // self.shard.world_size


def check_shard_size(shard_size: int, world_size: int) -> None:
    """Refuse a ``mics_shard_size`` that does not split ``world_size`` ranks into equal groups."""
    if shard_size in (-1, 0) or shard_size == world_size:
        return
    if shard_size < -1 or shard_size > world_size or world_size % shard_size:
        raise _not_a_divisor("mics_shard_size", shard_size, world_size, "-1")


def shard_groups(world: Comm, shard_size: int, *, gather_channel: bool) -> ShardGroups:
    """The groups for ``mics_shard_size`` ``shard_size`` over ``world`` (with ``gather_channel``, stage 3's
    parameter channel too).

    Collective: call on all ranks of the default group, which must be ``world``'s group where the groups
    are hybrid (``torch.distributed.new_group`` creates every group on every rank, in the same order).
    """
    check_shard_size(shard_size, world.world_size)
    size = world.world_size
    if shard_size in (-1, 0) or shard_size == size:
        return ShardGroups(world, world, None, world.new_channel("gather") if gather_channel else None)
    shards, mine = _consecutive(world, shard_size, "mics_shard_size")
    replicas = [list(range(j, size, shard_size)) for j in range(shard_size)]
    shard = _subgroups(world, shards, mine, "shard")
    gather = _subgroups(world, shards, mine, "gather") if gather_channel else None
    replica = _subgroups(world, replicas, world.rank % shard_size, "replica")
    return ShardGroups(world, shard, replica, gather)


def hpz_on(hpz_size: int, world_size: int) -> bool:
    """Whether ``zero_hpz_partition_size`` ``hpz_size`` makes groups smaller than the world."""
    return 1 < hpz_size < world_size


def check_hpz_size(hpz_size: int, world_size: int) -> None:
    """Refuse a ``zero_hpz_partition_size`` that does not split ``world_size`` ranks into equal groups."""
    if hpz_on(hpz_size, world_size) and world_size % hpz_size:
        raise _not_a_divisor("zero_hpz_partition_size", hpz_size, world_size, "1")


def _not_a_divisor(key: str, value: int, world_size: int, off: str) -> ValueError:
    return ValueError(
        f"zero_optimization.{key}: {value} is not allowed with {world_size} ranks; expected a divisor of the "
        f"world size {world_size} (or {off}: off)"
    )


def _consecutive(world: Comm, size: int, key: str) -> tuple[list[list[int]], int]:
    """The groups of ``size`` consecutive ranks of ``world`` and the index of this rank's; ``world`` must be
    every process (``key`` names the setting that asks for the groups)."""
    if dist.get_world_size() != world.world_size:
        raise ValueError(
            f"zero_optimization.{key}: {size} needs the data-parallel group to be every process "
            f"({dist.get_world_size()}); initialize(group=...) passed a group of {world.world_size}"
        )
    return [list(range(g, g + size)) for g in range(0, world.world_size, size)], world.rank // size


def hpz_group(world: Comm, hpz_size: int) -> Comm | None:
    """This rank's hpZ group ([Note: hpZ groups]), or None where ``hpz_size`` is off.

    Collective: call on all ranks of the default group, which must be ``world``'s group when on."""
    check_hpz_size(hpz_size, world.world_size)
    size = world.world_size
    if not hpz_on(hpz_size, size):
        return None
    groups, mine = _consecutive(world, hpz_size, "zero_hpz_partition_size")
    return _subgroups(world, groups, mine, "hpz")


def _subgroups(world: Comm, members: list[list[int]], mine: int, label: str) -> Comm:
    """One group per list of ``world`` ranks in ``members`` (created on every rank); this rank's as a Comm.

    Collective: call on all ranks of the default group."""
    out = None
    for index, ranks in enumerate(members):
        group = dist.new_group(ranks=[world.ranks[r] for r in ranks], timeout=world.timeout)
        if index == mine:
            out = Comm(group, world.timeout, monitor=world.monitor, label=label)
            out.stats = world.stats
            out.nodes = tuple(world.nodes[r] for r in ranks)
    if out is None:
        raise RuntimeError(f"rank {world.rank}: no {label} group holds this rank")
    return out


def all_reduce_grad_shards(units: Sequence[FlatUnit], replica: Comm, max_elements: int) -> None:
    """Sum every unit's gradient shard over the replica group, in the reduce dtype, at most
    ``max_elements`` per collective, units in reverse order as the reducer launches them ([Note: hybrid
    sharding]). Collective: call on all ranks of ``replica`` with the same units."""
    order = [u for u in sorted(units, key=lambda u: -u.index) if u.layout.shard_size]
    for dtype, same in itertools.groupby(order, key=lambda u: u.policy.reduce):
        run = list(same)
        for indices in split_into_units([u.layout.shard_size for u in run], max_elements):
            batch = [run[i] for i in indices]
            buf = torch.cat([u.grad_shard.to(dtype) for u in batch])
            what = f"gradient replica all_reduce of units {batch[0].index}-{batch[-1].index}"
            replica.all_reduce(buf, what=what).wait()
            offset = 0
            for unit in batch:
                unit.grad_shard.copy_(buf[offset : offset + unit.layout.shard_size])
                unit.grad_written()
                unit.grad_reduced = True
                offset += unit.layout.shard_size
