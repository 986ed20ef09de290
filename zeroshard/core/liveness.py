"""Telling a dead peer from a slow one, and naming what every rank was doing when a collective fails.

[Note: liveness]
Every process keeps, in memory and at no communication cost, the sequence number of each collective it
launched per group, a ring of its last collectives (group, number, operation, API, step) and the stack of
collective APIs it is inside (``save_checkpoint``, ``engine.step``, ...). With a process group of more than
one rank, ``initialize`` (and ``zero.Init``) also start a heartbeat (heartbeat.py): rank 0 hosts a small
``torch.distributed.TCPStore`` of its own (its port is shared once through a collective), and a daemon thread
in every process bumps its counter there every ``interval`` and publishes its state (the above, and what
it is blocked on) when it changed. That is one or two store round trips a second per process, none on
the training path.

Only while a collective wait has lasted longer than ``grace`` does the thread read its peers: a peer whose
counter has not moved for the heartbeat window is dead (a stopped process or a vanished host, which closes
no connection); a peer that failed is named; and a peer blocked on a collective this rank never launched,
while this rank waits on one that peer never launched, waits for this rank as this rank waits for it (e.g.
rank 0 in ``save_checkpoint`` while rank 1 trains on), as does a peer that launched this rank's collective
from another API, or, for a direct exchange, moving another unit: exchange messages are tagged with what
they move (comm.py [Note: direct exchange]), so those never pair (``judge``). The thread then records the
reason and breaks the wait (on gloo: an unmatched receive on the same group, timed out at once, makes gloo
close the group's connections), and the waiting thread raises :class:`CollectiveError` with that reason. A
crashed peer closes its connections itself; the error then waits a few heartbeats to say which peer stopped
beating. A live peer that never arrives fails at ``ZEROSHARD_COLLECTIVE_TIMEOUT_S``. Every error carries the
last collectives of every rank that can be read, side by side.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

logger = logging.getLogger(__name__)

RING = 16  # collectives each rank remembers
SHOWN = 6  # of which the error's table shows the newest

# Collective APIs: the entry check exchanges an index into this tuple (see Comm.check_entry).
APIS = (
    "initialize",
    "save_checkpoint",
    "load_checkpoint",
    "save_16bit_model",
    "full_state_dict",
    "gathered_parameters",
    "GatheredParameters",
    "zero.Init",
    "engine.forward",
    "engine.backward",
    "engine.step",
    "shutdown",
)


class CollectiveError(RuntimeError):
    """A collective failed or could not complete, or ranks entered different collective APIs.

    The message names this rank, the API and collective (its unit or module where it has one), the step,
    the ranks that did not arrive and why, and the last collectives of every rank that could be read.
    """


# A wait in progress: (group key, sequence number, what, api, step, since, global ranks of the group, a
# function that makes the wait raise when given a peer's global rank, or None, whether it is a direct
# exchange: point-to-point messages tagged with what they carry, see comm.py [Note: direct exchange])
Token = tuple[str, int, str, str, "int | None", float, tuple[int, ...], "Callable[[int], None] | None", bool]


class Comm(Protocol):
    """What ``heartbeat.start`` and :func:`collective_api` use of ``zeroshard.core.comm.Comm``."""

    rank: int
    world_size: int
    group: Any

    def all_gather_object(self, obj: Any, *, what: str = ...) -> list[Any]: ...
    def agree(self, value: int, *, what: str) -> list[int]: ...
    def check_entry(self, api: str, step: int | None) -> None: ...


class _Api:
    """``with monitor.api(name, step):`` marks the block as inside a collective API (see [Note: liveness])."""

    __slots__ = ("_entry", "_monitor")

    def __init__(self, monitor: Monitor, name: str, step: int | None) -> None:
        self._monitor, self._entry = monitor, (name, step)

    def __enter__(self) -> None:
        self._monitor.apis.append(self._entry)

    def __exit__(self, *exc: object) -> None:
        apis = self._monitor.apis
        if apis and apis[-1] is self._entry:
            apis.pop()
        self._monitor.last_api = self._entry


class Monitor:
    """This process's record of its collectives and, with a process group, its heartbeat.

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
        self.link: Any = None  # heartbeat._Link while a heartbeat runs

    def restart(self) -> None:
        """Forget the collectives and the failure of a previous process group (a new one starts)."""
        self.seq.clear()
        self.ring.clear()
        self.verdict = self.failed = None

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


# Why stage-3 ranks gather different parameters, and what to do about it (see
# zeroshard/core/stage3/gatherer.py).
STAGE3_ADVICE = (
    "ZeRO stage 3 needs every rank to run the same modules in the same order. A module that runs on some "
    "ranks only (data-dependent control flow) must not be gathered on its own: keep its parameters full "
    "with stage3_param_persistence_threshold >= its size, or gather it with a module every rank runs "
    "(zeroshard.set_z3_leaf_modules(model, [ParentClass]) or "
    "zeroshard.register_external_parameter(parent, param))"
)

TIMEOUT_HINT = (
    "ZEROSHARD_COLLECTIVE_TIMEOUT_S; another rank is alive but did not arrive: a hang or a slow rank"
)


def describe(state: dict[str, Any] | None) -> str:
    """One rank's published state in words: where it is and what it waits on."""
    if state is None:
        return "no state published"
    b = state.get("blocked")
    apis = state.get("apis") or []
    if b:
        where = f"in {b['api'] or 'no collective API'}" + (
            f" (step {b['step']})" if b["step"] is not None else ""
        )
        return f"{where}, waiting {b['for_s']}s on collective #{b['seq']} on group {b['key']} ({b['what']})"
    if apis:
        name, step = apis[0]
        return (
            f"in {name}" + (f" (step {step})" if step is not None else "") + ", not waiting on a collective"
        )
    last = state.get("last_api")
    return "outside any collective API" + (f" (last: {last[0]}, step {last[1]})" if last else "")


def last_collectives(states: dict[int, dict[str, Any]]) -> str:
    """Each rank's newest collectives side by side (``#number group API: what``), one column per rank."""
    if not states:
        return ""
    width = 44
    ranks = sorted(states)
    columns = []
    for r in ranks:
        ring = list(states[r].get("ring") or [])[-SHOWN:]
        cells = [f"#{seq} g{key} {api or '-'}: {what}"[:width] for key, seq, what, api, _ in ring]
        columns.append([""] * (SHOWN - len(cells)) + cells)
    header = " | ".join(f"rank {r}".ljust(width) for r in ranks)
    rows = [" | ".join(col[i].ljust(width) for col in columns).rstrip() for i in range(SHOWN)]
    return (
        "last collectives of each rank (newest last):\n  "
        + header.rstrip()
        + "\n  "
        + "\n  ".join(row for row in rows if row.strip())
    )


def judge(monitor: Monitor, b: Token, states: dict[int, dict[str, Any]], grace: float) -> str | None:
    """Why the wait ``b`` cannot complete, from the peers' published states; None while it still may."""
    key, seq, _what, api, step = b[:5]
    here = f"{api} (step {step})" if api else "outside any collective API"
    for r, state in states.items():
        if state.get("failed"):
            return f"rank {r} failed: {state['failed']}"
    for r, state in states.items():
        theirs = state.get("blocked")
        if not theirs or theirs["for_s"] < grace:
            continue
        other = _launched_as(state, key, seq)
        mine = _launched_as({"ring": monitor.ring_copy()}, key, seq) if b[8] else None
        if other is not None and mine is not None and other[3] == api and other[2] != mine[2]:
            # Exchange messages carry a tag made from what they move, so these never pair up.
            advice = STAGE3_ADVICE if "parameter all_gather" in mine[2] + other[2] else ""
            return (
                f"rank {r} launched collective #{seq} on group {key} as {other[2]!r}, this rank as "
                f"{mine[2]!r}: the ranks took different paths through the program and issued different "
                f"collectives at the same point. {advice}"
            ).rstrip()
        if other is not None and other[3] != api:
            return (
                f"rank {r} launched collective #{seq} on group {key} in {other[3] or 'no API'} ({other[2]}), "
                f"this rank in {api or 'no API'}: rank {r} is {describe(state)}. The ranks called different "
                f"collective APIs ({here} here): every rank must call the same ones in the same order"
            )
        if (
            other is None
            and state["seq"].get(key, 0) < seq
            and monitor.seq.get(theirs["key"], 0) < theirs["seq"]
        ):
            return (
                f"rank {r} never launched it and waits for this rank in turn: rank {r} is "
                f"{describe(state)}, a collective this rank never launched. The ranks called different "
                f"collective APIs ({here} here): every rank must call the same ones in the same order"
            )
    return None


def _launched_as(state: dict[str, Any], key: str, seq: int) -> list[Any] | None:
    """A peer's ring entry for collective #``seq`` on group ``key``, if it launched it and still has it."""
    return next((e for e in state.get("ring") or [] if e[0] == key and e[1] == seq), None)


def arrived(state: dict[str, Any] | None, key: str, seq: int, api: str) -> bool:
    """Whether a peer launched collective #``seq`` on group ``key`` too, in the same API as this rank."""
    if state is None or state["seq"].get(key, 0) < seq:
        return False
    other = _launched_as(state, key, seq)
    return other is None or other[3] == api


MONITOR = Monitor()


@contextlib.contextmanager
def collective_api(comm: Comm, name: str, step: int | None = None, check: bool = True) -> Iterator[None]:
    """Mark the block as inside the collective API ``name`` (one of ``APIS``) for the liveness records and,
    with ``check``, first make sure every rank entered it (``Comm.check_entry``). Collective with ``check``:
    call on all ranks."""
    with MONITOR.api(name, step):
        if check:
            comm.check_entry(name, step)
        yield
