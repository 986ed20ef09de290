"""Stage 3's check that every rank is about to gather the same units.

[Note: gather check]
Ranks that took different paths through the model (data-dependent control flow) would pair up
collectives that move different units. Two safeguards name the modules instead:

* On gloo with a heartbeat running (``Comm.watched``), nothing is sent: the direct exchanges are tagged
  with the unit they move (comm.py [Note: direct exchange]), so messages of different units never pair,
  and the heartbeat, once the waits have lasted its grace (about 2 s), names the unit each rank launched
  at that point (``watchdog.verdicts.judge``).
* Otherwise (NCCL, the heartbeat off, or its store gone) every burst of parameter gathers (the units a
  module needs now plus those prefetched with them) comes with a small fixed-size collective: each rank's
  [fingerprint, count, first ``SHOWN`` unit indices]. It always matches in size, so the ranks meet in it
  and every rank raises the same error naming the units each rank was about to gather. On gloo it is
  launched with the data and verified before the units are used, so its round trip overlaps the data's.
  NCCL runs collectives of different sizes without noticing, so there it is verified before the data
  moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from zeroshard.core.comm import Agreement, Comm
from zeroshard.core.liveness import STAGE3_ADVICE

# How many unit indices a check carries, so that a mismatch can name them without another collective.
SHOWN = 6


class GatherChecks:
    """The checks launched and not yet verified. ``describe(index)`` names a unit for the error.

    Collective: :meth:`launch` must be called on all ranks, in the same order.
    """

    def __init__(self, comm: Comm, describe: Callable[[int], str]) -> None:
        self.comm = comm
        self._describe = describe
        self._unverified: list[tuple[Agreement, set[int]]] = []  # with the unit indices each covers
        # Decided once, the same on every rank (the heartbeat started, or not, before the units existed).
        self._watched = comm.watched

    def launch(self, indices: list[int]) -> None:
        """Launch the check of a burst gathering ``indices``; on NCCL, verify it before returning. Nothing
        where the heartbeat watches the group's exchanges (``Comm.watched`` when the checks were made)."""
        if self._watched:
            return
        shown = indices[:SHOWN] + [-1] * (SHOWN - len(indices[:SHOWN]))
        check = self.comm.agree_async(
            [_sequence_key(indices), len(indices), *shown], what="stage-3 gather check"
        )
        self._unverified.append((check, set(indices)))
        if not self.comm.direct:
            self.verify()

    def verify(self, indices: Iterable[int] | None = None) -> None:
        """Verify the checks launched up to the last one that covers any of ``indices`` (all: None).

        Raises the same error on every rank when the ranks were about to gather different units.
        """
        wanted = None if indices is None else set(indices)
        last = len(self._unverified) - 1
        if wanted is not None:
            while last >= 0 and not (self._unverified[last][1] & wanted):
                last -= 1
        checks, self._unverified = self._unverified[: last + 1], self._unverified[last + 1 :]
        for check, _ in checks:
            rows = check.result()
            if any(row != rows[0] for row in rows):
                raise RuntimeError(self._mismatch(rows))

    def _mismatch(self, rows: list[list[int]]) -> str:
        by_rank = "; ".join(
            f"rank {r}: "
            + ", ".join(self._describe(i) for i in row[2 : 2 + min(row[1], SHOWN)])
            + (", ..." if row[1] > SHOWN else "")
            for r, row in enumerate(rows)
        )
        return (
            f"rank {self.comm.rank}: the ranks are about to gather different parameters ({by_rank}). "
            + STAGE3_ADVICE
        )


def _sequence_key(indices: list[int]) -> int:
    """An order-sensitive 62-bit fingerprint of a list of unit indices (equal lists, equal keys)."""
    key = len(indices)
    for index in indices:
        key = (key * 1_000_003 + index + 1) % (1 << 62)
    return key
