"""Pure shard arithmetic for one unit's flat parameter space.

[Note: flat layout]
A *unit* is a list of parameters that are communicated together. Its parameters are laid end to end, in
the given order, in one flat space of ``total`` elements, then padded with zeros to ``padded``, a multiple
of ``world_size``. Rank ``r`` owns the half-open range ``[r * shard_size, (r + 1) * shard_size)``. Padding
always sits at the end, so it belongs to the last ranks; a rank may own only padding (tiny units, many ranks).

Nothing here communicates or allocates tensors: it is arithmetic that can be tested exhaustively, and it is
the record checkpoints are written from, which is what makes resharding to another world size arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate


def _starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each of ``sizes`` starts when they are laid end to end from 0."""
    return tuple(accumulate(sizes, initial=0))[:-1]


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside one rank's shard.

    Attributes:
        index: position of the parameter in the unit.
        param_start: first element of the parameter (in its own flattened numbering) inside the shard.
        shard_start: where that element sits inside the shard.
        numel: how many consecutive elements the piece has (always > 0).
    """

    index: int
    param_start: int
    shard_start: int
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lives in the unit's flat, padded space.

    Invariants: ``offsets[i] + numels[i] <= offsets[i + 1]``; ``total == sum(numels)``;
    ``padded % world_size == 0`` and ``padded - total < world_size``.
    """

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"parameter sizes must be >= 0, got {self.numels}")

    @classmethod
    def for_shapes(cls, numels: Sequence[int], world_size: int) -> FlatLayout:
        return cls(tuple(int(n) for n in numels), int(world_size))

    @property
    def total(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return sum(self.numels)

    @property
    def padded(self) -> int:
        """Size of the flat space: ``total`` rounded up to a multiple of ``world_size``."""
        return -(-self.total // self.world_size) * self.world_size

    @property
    def shard_size(self) -> int:
        return self.padded // self.world_size

    @property
    def offsets(self) -> tuple[int, ...]:
        return _starts(self.numels)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The half-open range ``[start, end)`` of the flat space that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, rank: int) -> Iterator[Piece]:
        """The parameters (or parts of them) inside ``rank``'s shard, in flat order."""
        start, end = self.shard_range(rank)
        for index, (offset, numel) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(offset, start), min(offset + numel, end)
            if lo < hi:
                yield Piece(index=index, param_start=lo - offset, shard_start=lo - start, numel=hi - lo)

    def piece(self, rank: int, index: int) -> Piece | None:
        """Parameter ``index``'s part of ``rank``'s shard, or None where the shard holds none of it."""
        return next((p for p in self.pieces(rank) if p.index == index), None)

    def owner_ranks(self, index: int) -> range:
        """Ranks whose shard holds at least one element of parameter ``index``."""
        offset, numel = self.offsets[index], self.numels[index]
        if numel == 0:
            return range(0)
        return range(offset // self.shard_size, (offset + numel - 1) // self.shard_size + 1)


@dataclass(frozen=True)
class GroupLayout:
    """Several units' flat spaces in one buffer, rank by rank, so that one reduce-scatter reduces them all.

    [Note: coalesced reduction]
    Rank ``r``'s chunk of the buffer, ``[r * chunk, (r + 1) * chunk)``, holds shard ``r`` of every unit, end
    to end in the units' order (unit ``k``'s at ``offsets[k]`` inside the chunk). A reduce-scatter of the
    whole buffer therefore leaves on rank ``r`` exactly its shard of every unit. With one unit the buffer is
    that unit's flat space, element for element.

    Invariants: ``padded == world_size * chunk``; ``offsets[k] + shard_sizes[k] <= chunk``.
    """

    shard_sizes: tuple[int, ...]
    world_size: int

    @property
    def offsets(self) -> tuple[int, ...]:
        return _starts(self.shard_sizes)

    @property
    def chunk(self) -> int:
        """Elements of each rank's chunk: the sum of the units' shard sizes."""
        return sum(self.shard_sizes)

    @property
    def padded(self) -> int:
        return self.world_size * self.chunk

    def runs(self, k: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Where the range ``[lo, hi)`` of unit ``k``'s flat space lies in the buffer, as
        ``(buffer_start, range_start, numel)`` runs (``range_start`` counted from ``lo``), adjacent runs
        merged."""
        shard, offset, chunk = self.shard_sizes[k], self.offsets[k], self.chunk
        runs: list[tuple[int, int, int]] = []
        pos = lo
        while pos < hi:
            rank = pos // shard
            end = min(hi, (rank + 1) * shard)
            start = rank * chunk + offset + pos - rank * shard
            if runs and runs[-1][0] + runs[-1][2] == start:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + end - pos)
            else:
                runs.append((start, pos - lo, end - pos))
            pos = end
        return runs


def split_into_units(numels: Sequence[int], max_elements: int) -> list[list[int]]:
    """Group consecutive parameters (by index) into units of at most ``max_elements`` elements.

    A parameter larger than ``max_elements`` gets a unit of its own; order is preserved, so every rank that
    calls this with the same sizes gets the same units.
    """
    if max_elements < 1:
        raise ValueError(f"max_elements must be >= 1, got {max_elements}")
    units: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, numel in enumerate(numels):
        if current and size + numel > max_elements:
            units.append(current)
            current, size = [], 0
        current.append(index)
        size += numel
    if current:
        units.append(current)
    return units
