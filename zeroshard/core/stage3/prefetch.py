"""Stage 3: which units to gather ahead of need, and which to keep, from the order of the previous step.

[Note: prefetch schedule]
Every rank runs the same modules, so the order in which units were needed in one step is the order of the
next. :class:`PrefetchSchedule` records this step's order as the gatherer asks for units and replays the
previous step's: a cursor follows it, the units after the cursor are gathered ahead (within
``prefetch_bucket_size`` and ``max_live_parameters``), their NVMe shards are read further ahead, and a unit
needed again soon (within ``max_reuse_distance``) is kept gathered instead of released. Pure bookkeeping:
it launches nothing itself (``gatherer.ParameterGatherer`` does, on every rank in the same order).
"""

from __future__ import annotations

from collections.abc import Collection

from zeroshard.core.flat_param import FlatUnit


class PrefetchSchedule:
    """This step's order of needed units and the previous step's, with a cursor into the latter."""

    def __init__(self, *, prefetch_elements: int, max_live_elements: int, max_reuse_distance: int) -> None:
        self.prefetch_elements = prefetch_elements
        self.max_live_elements = max_live_elements
        self.max_reuse_distance = max_reuse_distance
        self._order: list[FlatUnit] = []  # gathers of this step, in order
        self._schedule: list[FlatUnit] = []  # the previous step's order, for prefetching
        self._cursor = 0

    def record(self, needed: list[FlatUnit]) -> None:
        """``needed`` are needed now, in this order: record them and move the cursor past the last."""
        self._order.extend(needed)
        if needed:
            self._advance_cursor(needed[-1])

    def _advance_cursor(self, current: FlatUnit) -> None:
        """Follow last step's order: move past the next place where ``current`` was requested."""
        for pos in range(self._cursor, len(self._schedule)):
            if self._schedule[pos] is current:
                self._cursor = pos + 1
                return

    def candidates(self, now: list[FlatUnit], live_elements: int, done: Collection[int]) -> list[FlatUnit]:
        """Units that followed in last step's order, within the prefetch and live-parameter budgets.

        ``live_elements`` counts the units gathered or about to be (``now``); units in ``done`` (released
        in this backward) are never gathered again before it ends.
        """
        if not self._schedule or self.prefetch_elements <= 0:
            return []
        budget = self.prefetch_elements
        live = live_elements
        out: list[FlatUnit] = []
        for unit in self._schedule[self._cursor :]:
            if budget <= 0:
                break
            if not unit.gathered and unit.index not in done and unit not in now and unit not in out:
                if live + unit.layout.padded > self.max_live_elements:
                    break  # stage3_max_live_parameters
                out.append(unit)
                live += unit.layout.padded
            budget -= unit.layout.padded
        return out

    def read_ahead(self) -> None:
        """Start reading NVMe-offloaded shards of the units that follow in last step's order, twice the
        prefetch budget ahead, so a gather finds its shard in memory (no-op for shards in memory)."""
        budget = 2 * self.prefetch_elements
        for unit in self._schedule[self._cursor :]:
            if budget <= 0:
                break
            unit.prefetch_shard()
            budget -= unit.layout.padded

    def reused_soon(self, unit: FlatUnit) -> bool:
        """Whether last step's order uses ``unit`` again soon enough to keep it gathered.

        Soon enough is within ``max_reuse_distance`` elements, counting the unit's own elements plus
        everything gathered before its next use (so 0 never keeps a unit for that reason, and DeepSpeed's
        default, 1e9, keeps every unit of a smaller model gathered from its forward to its backward); or
        within the prefetch window, where the next gather would only fetch the same bytes again (the last
        modules of the forward, which the backward needs first). Where last step's order ends within that
        window, the unit is kept too: that order ended with this forward because its backward found these
        units kept, and releasing them now would make this backward gather them again (and keeping or not
        would alternate from step to step).
        """
        distance = unit.layout.padded
        limit = max(self.max_reuse_distance, self.prefetch_elements)
        for upcoming in self._schedule[self._cursor :]:
            if distance > limit:
                return False
            if upcoming is unit:
                return True
            distance += upcoming.layout.padded
        return bool(self._schedule) and distance <= limit

    @property
    def exhausted(self) -> bool:
        """Whether this step has asked for the last unit of last step's order (nothing is left to gather
        ahead)."""
        return bool(self._schedule) and self._cursor >= len(self._schedule)

    def end_step(self) -> None:
        """This step's order becomes the schedule of the next (a step that gathered nothing keeps the old)."""
        if self._order:
            self._schedule = self._order
        self._order = []
        self._cursor = 0
