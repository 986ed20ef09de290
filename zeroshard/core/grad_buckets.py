"""The gradient buckets being filled: one per reduction group, laid out rank by rank ([Note: gradient flow]
in ``grad_sync.py``; [Note: coalesced reduction] in ``layout.py``). Local: it launches nothing."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from zeroshard.core.buffers import BufferPool
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.reduction_groups import ReductionGroup

Runs = list[tuple[int, int, int]]  # (start in the bucket, offset in the parameter, elements)


def _zero(bucket: torch.Tensor, runs: Runs) -> None:
    for start, _, numel in runs:
        bucket[start : start + numel].zero_()


def _spans_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous and is the whole of its storage (not a view into a larger tensor).

    A gradient handed to a post-accumulate hook that passes this is the parameter's own: autograd's
    AccumulateGrad copies an incoming gradient that anything else still references, so the reducer may read
    it as its bucket (it only reads it: see ``GradientBuckets._adopt``).
    """
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class GradientBuckets:
    """Each sharded-gradient group's bucket from its first gradient of a backward to its reduction.

    Buckets come from ``pool`` (contents arbitrary): the padding is zeroed when a bucket is taken, the
    parameters' ranges are written as their gradients arrive, and :meth:`take` zeroes the ranges no gradient
    was written into. ``prescaled``: the reducer multiplies buckets in place before reducing them, so a
    bucket may never be autograd's own gradient.
    """

    def __init__(
        self,
        groups: Sequence[ReductionGroup],
        pool: BufferPool,
        dtype_of: Callable[[FlatUnit], torch.dtype],
        *,
        prescaled: bool,
    ) -> None:
        self.pool = pool
        self._dtype_of = dtype_of
        self._prescaled = prescaled
        # Where each parameter's gradient, and each unit's padding, lies in its group's bucket: computed once.
        self._runs: dict[int, list[Runs]] = {}
        self._padding: dict[int, Runs] = {}
        for group in (g for g in groups if not g.keeps_full):
            for k, unit in enumerate(group.units):
                runs = group.layout.runs
                self._runs[unit.index] = [runs(k, *unit.param_range(i)) for i in range(len(unit.params))]
                self._padding[unit.index] = runs(k, unit.layout.total, unit.layout.padded)
        self._buckets: dict[int, torch.Tensor] = {}  # per group
        self._adopted: set[int] = set()  # groups whose bucket is autograd's gradient, not the pool's
        self._filled: dict[int, list[int]] = {}  # per unit, the parameters written into its group's bucket

    def write(
        self,
        group: ReductionGroup,
        unit: FlatUnit,
        i: int,
        grad: torch.Tensor,
        *,
        adoptable: bool,
        repeat: bool,
    ) -> bool:
        """Put parameter ``i``'s gradient into ``group``'s bucket (added to what is there with ``repeat``: a
        second gradient in one backward); with ``adoptable`` (no one else can hold ``grad``) it may become
        the bucket itself. Return whether a bucket was started."""
        bucket = self._buckets.get(group.index)
        if bucket is None and adoptable and self._adopt(group, unit, i, grad):
            self._filled[unit.index] = [i]
            return True
        started = bucket is None
        if bucket is None:
            bucket = self._new(group)
            self._buckets[group.index] = bucket
        flat = grad.reshape(-1)
        for start, offset, numel in self._runs[unit.index][i]:
            if repeat:
                bucket[start : start + numel].add_(flat[offset : offset + numel])
            else:
                bucket[start : start + numel].copy_(flat[offset : offset + numel])
        if not repeat:
            self._filled[unit.index].append(i)
        return started

    def take(self, group: ReductionGroup) -> tuple[torch.Tensor, bool]:
        """``group``'s bucket, complete (a new zero one where no gradient arrived on this rank), and whether
        it is autograd's gradient rather than the pool's."""
        bucket = self._buckets.pop(group.index, None)
        if bucket is None:
            bucket = self._new(group)
        for unit in group.units:
            filled = set(self._filled.pop(unit.index, []))
            for i in sorted(set(range(len(unit.params))) - filled):
                _zero(bucket, self._runs[unit.index][i])
        adopted = group.index in self._adopted
        self._adopted.discard(group.index)
        return bucket, adopted

    @property
    def filling_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buckets.values())

    def clear(self) -> None:
        self._buckets.clear()
        self._adopted.clear()
        self._filled.clear()

    def _adopt(self, group: ReductionGroup, unit: FlatUnit, i: int, grad: torch.Tensor) -> bool:
        """Take autograd's gradient itself as the bucket of a group that is exactly this one parameter (a
        unit of one unpadded parameter, e.g. a large embedding): no bucket beside the gradient, no copy."""
        n = grad.numel()
        if len(group.units) != 1 or len(unit.params) != 1 or group.layout.padded != n:
            return False
        if self._runs[unit.index][i] != [(0, 0, n)] or grad.dtype != self._dtype_of(unit):
            return False
        if grad.device != unit.device or not _spans_its_storage(grad):
            return False  # a view of a larger tensor: copy it into a bucket instead
        if self._prescaled:
            return False  # prescaling writes into the bucket: never into a tensor autograd handed us
        self._buckets[group.index] = grad.view(-1)
        self._adopted.add(group.index)
        return True

    def _new(self, group: ReductionGroup) -> torch.Tensor:
        first = group.units[0]
        bucket = self.pool.take(group.layout.padded, self._dtype_of(first), first.full.device)
        for unit in group.units:
            _zero(bucket, self._padding[unit.index])
            self._filled[unit.index] = []
        return bucket
