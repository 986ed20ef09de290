"""Gradient reductions launched and not yet waited for, and when one may be waited for early.

[Note: bounded reductions]
A bucket in flight is memory: left alone, every bucket of a stage-3 backward would live until its end, the
whole model's gradients (the point-to-point exchanges of comm.py hold their buffers until waited for). So once
more than ``MAX_INFLIGHT`` reductions are in flight the oldest is waited for, but only once every rank is
known to have launched it. Waiting for one that a peer has not launched can deadlock: a peer whose unit lacks
a gradient (a parameter unused on that rank) launches it only at the end of its backward, which may need this
rank's next parameter gather. So each launch also launches a tiny collective, a marker, on the same group; a
marker completes only when every rank has launched its reduction, and completion is polled, never waited for.
Every rank launches the same markers in the same order: one per group's reduction, except for the last
``MAX_INFLIGHT`` groups, which are never the oldest beyond the bound before the end of backward waits for
every reduction (and which :meth:`InFlight.retire_launched` leaves in flight). Where parameters are not
gathered in backward (stages 0-2) a peer reaches every launch without waiting for this rank, so there is no
marker: the oldest reduction beyond ``MAX_INFLIGHT`` is waited for at once, which bounds stage 2's buckets
by the unit size times ``MAX_INFLIGHT + 1`` whatever the model's size.

The same holds for a stage-3 backward that begins with every unit gathered (DeepSpeed's default
``stage3_max_reuse_distance`` keeps a smaller model's units from forward to backward): no rank gathers in it,
so no peer can be waiting for this rank's gather. Whether a backward is such a *gather-free* one is decided
at its start, the same on every rank (which units are gathered follows last step's order), so every rank
launches the same markers, none. It stays gather-free: units whose gradients were reduced are not gathered
again in the same backward (``stage3/gatherer.py``), no unit is spent early (a recomputation would gather it
again), and a gather asked for anyway raises an error instead of risking the wait. Without this a rank that
runs ahead would hold every bucket it launched until a peer catches up, since no gather makes the ranks meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zeroshard.core.comm import Agreement, Pending

# With overlap_comm, how many group reductions may stay in flight while backward goes on, beyond which the
# oldest is waited for when that is safe ([Note: bounded reductions]).
MAX_INFLIGHT = 2


@dataclass
class _Reduction:
    pending: Pending
    then: Callable[[], None]  # what to do once it is done (sum into the shards, give the buffers back)
    held: int  # bucket bytes it holds
    marker: Agreement | None  # completes once every rank has launched it
    guarded: bool  # waiting for it before every rank launched it could deadlock


class InFlight:
    """The reductions in flight, oldest first (see [Note: bounded reductions]). Local: it launches nothing."""

    def __init__(self) -> None:
        self._reductions: list[_Reduction] = []
        self.bytes = 0  # bucket bytes held by them

    def add(
        self,
        pending: Pending,
        then: Callable[[], None],
        held: int,
        *,
        marker: Agreement | None,
        guarded: bool,
    ) -> None:
        self._reductions.append(_Reduction(pending, then, held, marker, guarded))
        self.bytes += held

    def wait_all(self) -> None:
        """Wait for every reduction (the end of backward: every rank launches all of them by then)."""
        while self._reductions:
            self._retire_oldest()

    def retire_safely(self, limit: int = MAX_INFLIGHT) -> None:
        """Wait for the oldest reductions beyond ``limit`` that every rank is known to have launched."""
        while len(self._reductions) > limit:
            oldest = self._reductions[0]
            if oldest.guarded and (oldest.marker is None or not oldest.marker.done()):
                return  # not known to be launched everywhere (no marker: one of the last groups)
            self._retire_oldest()

    def retire_launched(self) -> None:
        """Wait for the oldest reductions as long as every rank is known to have launched them (never for one
        a peer may not have launched yet); their buckets go back to the pool. The stage-3 gatherer calls it
        before trimming the pool ([Note: reducer and gatherer])."""
        self.retire_safely(limit=0)

    def _retire_oldest(self) -> None:
        oldest = self._reductions.pop(0)
        oldest.pending.wait()
        if oldest.marker is not None:
            oldest.marker.result()  # done already, or (at the end of backward) about to be
        oldest.then()
        self.bytes -= oldest.held
