"""Telling a dead peer from a slow one, and naming what every rank was doing when a collective fails.

[Note: liveness]
Every process keeps, in memory and at no communication cost, the sequence number of each collective it
launched per group, a ring of its last collectives (group, number, operation, API, step) and the stack of
collective APIs it is inside (``save_checkpoint``, ``engine.step``, ...): a :class:`LivenessMonitor`, which
``initialize`` (and ``zero.Init``) create and hand to their ``Comm``, which reports to it
(``zeroshard/core/liveness.py``: core knows the monitor only as that interface). With a process group of
more than one rank, they also start a heartbeat (``heartbeat.py``): rank 0 hosts a small
``torch.distributed.TCPStore`` of its own (its port is shared once through a collective), and a daemon thread
in every process bumps its counter there every ``interval`` and publishes its monitor's state (the above,
and what it is blocked on) when it changed. That is one or two store round trips a second per process, none
on the training path. One heartbeat watches a world: a second engine over the same world takes the running
heartbeat's monitor (``heartbeat.monitor_for_world``).

Only while a collective wait has lasted longer than ``grace`` does the thread read its peers: a peer whose
counter has not moved for the heartbeat window is dead (a stopped process or a vanished host, which closes
no connection); a peer that failed is named; and a peer blocked on a collective this rank never launched,
while this rank waits on one that peer never launched, waits for this rank as this rank waits for it (e.g.
rank 0 in ``save_checkpoint`` while rank 1 trains on), as does a peer that launched this rank's collective
from another API, or, for a direct exchange, moving another unit: exchange messages are tagged with what
they move (comm.py [Note: direct exchange]), so those never pair (``verdicts.judge``). The thread then
records the reason and breaks the wait (on gloo: an unmatched receive on the same group, timed out at once,
makes gloo close the group's connections), and the waiting thread raises :class:`CollectiveError` with that
reason. A crashed peer closes its connections itself; the error then waits a few heartbeats to say which
peer stopped beating. A live peer that never arrives fails at ``ZEROSHARD_COLLECTIVE_TIMEOUT_S``. Every
error carries the last collectives of every rank that can be read, side by side.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from zeroshard.core.liveness import TIMEOUT_HINT, CollectiveError
from zeroshard.watchdog.verdicts import RING, Token, arrived, judge, last_collectives


class _Api:
    """``with monitor.api(name, step):`` marks the block as inside a collective API (see [Note: liveness])."""

    __slots__ = ("_entry", "_monitor")

    def __init__(self, monitor: LivenessMonitor, name: str, step: int | None) -> None:
        self._monitor, self._entry = monitor, (name, step)

    def __enter__(self) -> None:
        self._monitor.apis.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        apis = self._monitor.apis
        if apis and apis[-1] is self._entry:
            apis.pop()
        self._monitor.last_api = self._entry


class LivenessMonitor:
    """The records of the collectives launched through the ``Comm`` objects it was handed to (the
    :class:`~zeroshard.core.liveness.Monitor` they report to), and what its heartbeat publishes and judges.

    ``initialize`` and ``zero.Init`` create one (``heartbeat.monitor_for_world``: the running heartbeat's
    when one watches this world, so that every engine of the process is watched) and hand it to their
    ``Comm``, and so to the engine.

    Invariants: ``seq[key]`` counts the collectives launched on the group named ``key``, the same on every
    rank of a group whose ranks run the same program; only the calling thread writes ``seq``, ``ring``,
    ``apis`` and ``blocked``; the heartbeat thread reads them and writes ``verdict``.
    """

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}
        self.ring: deque[tuple[str, int, str, str, int | None]] = deque(maxlen=RING)
        self.apis: list[tuple[str, int | None]] = []
        self.last_api: tuple[str, int | None] | None = None
        self.blocked: Token | None = None
        self.verdict: tuple[Token, str] | None = None
        self.failed: str | None = None
        self.link: Any = None  # heartbeat.Link while a heartbeat watches this monitor

    def restart(self) -> None:
        """Forget the collectives and the failure of a previous process group (a new one starts)."""
        self.seq.clear()
        self.ring.clear()
        self.verdict = self.failed = None

    @property
    def watched(self) -> bool:
        """Whether a heartbeat watches this monitor's waits."""
        return self.link is not None

    # -- the calling thread: no communication ------------------------------------------------------------
    def note(self, key: str, op: str, what: str) -> int:
        """Count a collective launched on group ``key``; returns its sequence number there."""
        seq = self.seq.get(key, 0) + 1
        self.seq[key] = seq
        name, step = self.apis[0] if self.apis else ("", None)
        self.ring.append((key, seq, f"{op}: {what}" if op and op not in what else what, name, step))
        return seq

    def ring_copy(self) -> list[tuple[str, int, str, str, int | None]]:
        """A copy of the ring, safe to take from another thread while this one appends to it."""
        for _ in range(5):
            try:
                return list(self.ring)
            except RuntimeError:  # mutated while copied
                continue
        return []

    def api(self, name: str, step: int | None = None) -> _Api:
        return _Api(self, name, step)

    def where(self) -> tuple[str, int | None]:
        """The outermost collective API this rank is in, and its step ("" when none)."""
        return self.apis[0] if self.apis else ("", None)

    def block(
        self,
        key: str,
        seq: int,
        what: str,
        ranks: tuple[int, ...],
        breaker: Callable[[int], None] | None,
        exchange: bool = False,
    ) -> Token:
        name, step = self.where()
        token: Token = (key, seq, what, name, step, time.monotonic(), ranks, breaker, exchange)
        self.blocked = token
        return token

    def unblock(self, token: Token) -> None:
        if self.blocked is token:
            self.blocked = None

    def snapshot(self, now: float) -> dict[str, Any]:
        """What the heartbeat thread publishes (called from that thread: copies retried if mutated)."""
        for _ in range(5):
            try:
                ring, seq, apis = list(self.ring), dict(self.seq), list(self.apis)
                break
            except RuntimeError:  # mutated while copied
                continue
        else:
            ring, seq, apis = [], {}, []
        b = self.blocked
        return {
            "ring": ring,
            "seq": seq,
            "apis": apis,
            "last_api": self.last_api,
            "blocked": None
            if b is None
            else {
                "key": b[0],
                "seq": b[1],
                "what": b[2],
                "api": b[3],
                "step": b[4],
                "for_s": round(now - b[5], 1),
            },
            "failed": self.failed,
        }

    # -- failures -------------------------------------------------------------------------------------
    def failure(
        self, token: Token, err: BaseException, rank: int, timeout: datetime.timedelta | None, waited: float
    ) -> CollectiveError:
        """The error a failed or timed-out wait raises (see [Note: liveness]); publishes it to the peers."""
        key, seq, what, api, step, _, ranks, _, _ = token
        verdict = self.verdict[1] if self.verdict is not None and self.verdict[0] is token else None
        self.verdict = None
        text = str(err)
        timed_out = timeout is not None and waited >= 0.95 * timeout.total_seconds()
        link = self.link
        states: dict[int, dict[str, Any]] = {}
        notes: list[str] = []
        if link is not None:
            states, notes = link.explain(token, settle=verdict is None and not timed_out)
        if verdict is not None:
            reason = verdict
        elif timed_out:
            reason = f"did not complete within {timeout} ({TIMEOUT_HINT})"
        else:
            # A peer that judged first broke the connection: unless it published its failure (shown
            # below), its state may still say why.
            failed = any(state.get("failed") for state in states.values())
            why = judge(self, token, states, 0.0) if states and not failed else None
            reason = f"failed: {text}" + (f"\nwhy, from the peers' states: {why}" if why else "")
        peers = [r for r in ranks if r != rank]
        if link is None:
            missing = "which ranks did not arrive is unknown (no heartbeat: world size 1 or heartbeat off)"
        else:
            late = [r for r in peers if not arrived(states.get(r), key, seq, api)]
            missing = f"ranks that did not arrive: {late or 'none'}"
        where = f"{api} (step {step})" if api and step is not None else (api or "outside any collective API")
        head = f"rank {rank}: {where}: collective #{seq} on group {key} ({what}) {reason}"
        self.failed = head[:500]
        if link is not None:
            link.publish()
        states[rank] = {"ring": list(self.ring), "seq": dict(self.seq), "apis": list(self.apis)}
        lines = [head, f"{missing}.", *notes, last_collectives(states)]
        return CollectiveError("\n".join(line for line in lines if line))
