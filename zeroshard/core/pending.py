"""Waiting for collectives: :class:`Pending` (one in flight, its wait bounded by a timeout), the byte and wait
counts (:class:`CommStats`) and the timeout itself. ``comm.py`` launches the collectives; this module only
waits for them, and on a failed or stuck wait raises the :class:`CollectiveError` the launching ``Comm``'s
monitor makes of it.

[Note: communication wait]
``CommStats.wait_s_by_op`` is the wall time spent inside ``Pending.wait()`` of the model-state collectives
(comm.py [Note: communication volume]): how long the caller was blocked on communication, not how long the
transfer took. Traffic that overlaps compute (``overlap_comm``) and finishes before it is waited for costs
no wait at all, which is the point of overlapping. On gloo (CPU) ``wait()`` returns when the collective is
done. On NCCL it only makes the current CUDA stream wait and returns at once, so the host-side wait is close
to zero and the transfer's cost shows up in the timers that synchronize the device
(``wall_clock_breakdown``). The small control collectives (overflow flags, norms, ``agree``) are neither
counted nor timed.
"""

from __future__ import annotations

import datetime
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from zeroshard.core.liveness import CollectiveError, Monitor


class Channel(Protocol):
    """What a wait needs from the :class:`~zeroshard.core.comm.Comm` that launched it."""

    key: str  # the group's name in the liveness records
    ranks: tuple[int, ...]  # its global ranks
    breaker: Callable[[int], None] | None  # how the heartbeat thread ends a stuck wait (gloo only)
    monitor: Monitor  # told that the wait blocks, and makes the error of a failed one


DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
TIMEOUT_ENV = "ZEROSHARD_COLLECTIVE_TIMEOUT_S"


def collective_timeout() -> datetime.timedelta:
    """How long any collective may wait: ``$ZEROSHARD_COLLECTIVE_TIMEOUT_S`` seconds, else 10 minutes."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be > 0")
    return datetime.timedelta(seconds=seconds)


@dataclass
class CommStats:
    """Bytes moved and seconds waited, per kind of collective, since the last :meth:`reset`.

    See [Note: communication volume] for how bytes are counted and [Note: communication wait] for what the
    wait time measures.
    """

    bytes_by_op: Counter[str] = field(default_factory=Counter)
    calls_by_op: Counter[str] = field(default_factory=Counter)
    wait_s_by_op: dict[str, float] = field(default_factory=dict)
    """Seconds spent blocked in ``Pending.wait()``, per kind of collective."""
    control_calls: int = 0
    """Small control collectives launched (flags, norms, agreements): counted; they carry no model state."""
    bytes_by_group: Counter[str] = field(default_factory=Counter)
    """The same bytes by the group they moved on: the ``label`` of the :class:`~zeroshard.core.comm.Comm`
    ("world", "shard", "replica", "gather")."""
    cross_node_bytes: int = 0
    """Bytes this rank sent to a rank on another node (comm.py [Note: bytes across nodes])."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    @property
    def total_wait_s(self) -> float:
        return sum(self.wait_s_by_op.values())

    def add(self, op: str, nbytes: int, *, group: str = "world", cross_node: int = 0) -> None:
        self.bytes_by_op[op] += nbytes
        self.calls_by_op[op] += 1
        self.bytes_by_group[group] += nbytes
        self.cross_node_bytes += cross_node

    def add_wait(self, op: str, seconds: float) -> None:
        self.wait_s_by_op[op] = self.wait_s_by_op.get(op, 0.0) + seconds

    def reset(self) -> None:
        self.bytes_by_op.clear()
        self.calls_by_op.clear()
        self.wait_s_by_op.clear()
        self.control_calls = 0
        self.bytes_by_group.clear()
        self.cross_node_bytes = 0


class Pending:
    """A collective in flight; :meth:`wait` raises if it does not finish within the timeout.

    ``work`` is one ``torch.distributed`` work handle or a list of them (a point-to-point exchange, see
    comm.py [Note: direct exchange]); ``then`` runs once all of them are done (e.g. summing received chunks).
    With ``stats``, the time :meth:`wait` blocks is added to ``stats`` under ``op`` (see
    [Note: communication wait]). ``channel`` and ``seq`` (the launching :class:`Comm` and the collective's
    number on its group) let a failed or stuck wait raise :class:`CollectiveError` naming the ranks that did
    not arrive (the channel's monitor: see [Note: liveness] in zeroshard/watchdog/monitor.py).
    """

    def __init__(
        self,
        work: Any,
        what: str,
        rank: int,
        timeout: datetime.timedelta | None,
        *,
        stats: CommStats | None = None,
        op: str = "",
        then: Callable[[], None] | None = None,
        channel: Channel | None = None,
        seq: int = 0,
        exchange: bool = False,
    ) -> None:
        self._work = work
        self._what = what
        self._rank = rank
        self._timeout = timeout
        self._stats = stats
        self._op = op
        self._then = then
        self._channel = channel
        self._seq = seq
        self._exchange = exchange  # a direct exchange: see comm.py [Note: direct exchange]

    def and_then(self, fn: Callable[[], None]) -> Pending:
        """Run ``fn`` once the collective is waited for, after its own ``then`` (at once if already done)."""
        if self._work is None:
            fn()
            return self
        first = self._then

        def both() -> None:
            if first is not None:
                first()
            fn()

        self._then = both
        return self

    def done(self) -> bool:
        """Whether the collective has completed, without waiting (gloo's send/recv never say so)."""
        works = self._work if isinstance(self._work, list) else [self._work]
        return all(w is None or w.is_completed() for w in works)

    def wait(self) -> None:
        if self._work is None:
            return
        work, self._work = self._work, None
        start = time.perf_counter()
        try:
            self._wait(work if isinstance(work, list) else [work])
        finally:
            if self._stats is not None:
                self._stats.add_wait(self._op, time.perf_counter() - start)
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def _wait(self, works: list[Any]) -> None:
        start = time.monotonic()
        deadline = None if self._timeout is None else start + self._timeout.total_seconds()
        c = self._channel
        token: Any = None
        if c is not None:
            token = c.monitor.block(c.key, self._seq, self._what, c.ranks, c.breaker, self._exchange)
        try:
            for work in works:
                if deadline is None:
                    work.wait()  # bounded by the process group's own timeout
                else:
                    work.wait(timeout=datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as err:
            if c is None:
                raise CollectiveError(f"rank {self._rank}: {self._what} failed: {err}") from err
            waited = time.monotonic() - start
            raise c.monitor.failure(token, err, self._rank, self._timeout, waited) from err
        finally:
            if c is not None:
                c.monitor.unblock(token)


DONE = Pending(None, "", 0, None)


class Agreement:
    """A launched :meth:`Comm.agree_async`: every rank's list of ints once :meth:`result` returns."""

    def __init__(self, pending: Pending, rows: torch.Tensor) -> None:
        self._pending = pending
        self._rows = rows

    def done(self) -> bool:
        """Whether every rank's list has arrived (without waiting)."""
        return self._pending.done()

    def result(self) -> list[list[int]]:
        self._pending.wait()
        return self._rows.tolist()
