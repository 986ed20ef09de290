"""Telling a dead peer from a slow one, and naming what every rank was doing when a collective fails.

[Note: liveness]
Every process keeps, in memory and at no communication cost, the sequence number of each collective it
launched per group, a ring of its last collectives (group, number, operation, API, step) and the stack of
collective APIs it is inside (``save_checkpoint``, ``engine.step``, ...). With a process group of more than
one rank, ``initialize`` (and ``zero.Init``) also start a heartbeat: rank 0 hosts a small
``torch.distributed.TCPStore`` of its own (its port is shared once through a collective), and a daemon thread
in every process bumps its counter there every ``interval`` and publishes its state (the above, and what
it is blocked on) when it changed. That is one or two store round trips a second per process, none on
the training path.

Only while a collective wait has lasted longer than ``grace`` does the thread read its peers: a peer whose
counter has not moved for the heartbeat window is dead (a stopped process or a vanished host, which closes
no connection); a peer that failed is named; and a peer blocked on a collective this rank never
launched, while this rank waits on one that peer never launched, waits for this rank as this rank waits
for it (e.g. rank 0 in ``save_checkpoint`` while rank 1 trains on). The thread then records the reason
and breaks the wait (on gloo: an unmatched receive on the same group, timed out at once, makes gloo close
the group's connections), and the waiting thread raises :class:`CollectiveError` with that reason. A crashed
peer closes its connections itself; the error then waits a few heartbeats to say which peer stopped
beating. A live peer that never arrives fails at ``ZEROSHARD_COLLECTIVE_TIMEOUT_S``. Every error carries
the last collectives of every rank that can be read, side by side.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch.distributed as dist

logger = logging.getLogger(__name__)

HEARTBEAT_ENV = "ZEROSHARD_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 30.0
RING = 16  # collectives each rank remembers
SHOWN = 6  # of which the error's table shows the newest
_PREFIX = "zeroshard/liveness/"

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


def heartbeat_window() -> float:
    """Seconds without a heartbeat after which a peer is dead: ``$ZEROSHARD_HEARTBEAT_TIMEOUT_S``, else 30;
    0 turns the heartbeat off."""
    raw = os.environ.get(HEARTBEAT_ENV)
    if raw is None:
        return DEFAULT_HEARTBEAT_S
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{HEARTBEAT_ENV}={raw!r} must be a finite number >= 0 (0: off)")
    return seconds


# A wait in progress: (group key, sequence number, what, api, step, since, global ranks of the group, a
# function that makes the wait raise when given a peer's global rank, or None)
Token = tuple[str, int, str, str, "int | None", float, tuple[int, ...], "Callable[[int], None] | None"]


class Comm(Protocol):
    """What :func:`start` and :func:`collective_api` use of ``zeroshard.core.comm.Comm``."""

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
        self.link: _Link | None = None

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

    def api(self, name: str, step: int | None = None) -> _Api:
        return _Api(self, name, step)

    def where(self) -> tuple[str, int | None]:
        """The outermost collective API this rank is in, and its step ("" when none)."""
        return self.apis[0] if self.apis else ("", None)

    def block(
        self, key: str, seq: int, what: str, ranks: tuple[int, ...], breaker: Callable[[int], None] | None
    ) -> Token:
        name, step = self.where()
        token: Token = (key, seq, what, name, step, time.monotonic(), ranks, breaker)
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
        key, seq, what, api, step, _, ranks, _ = token
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
            reason = f"failed: {text}"
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


class _Link:
    """The store and heartbeat thread of one process group (see [Note: liveness])."""

    def __init__(
        self, monitor: Monitor, store: Any, rank: int, ranks: tuple[int, ...], window: float, world: Any
    ) -> None:
        self.monitor, self.store, self.rank, self.ranks, self.window = monitor, store, rank, ranks, window
        self.interval = min(1.0, window / 10)
        self.grace = max(0.5, 2 * self.interval)
        self.world = world
        self.broken: str | None = None  # why the store cannot be reached any more
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._published = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zeroshard-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
        state = json.dumps(self.monitor.snapshot(time.monotonic()), default=str)
        if state != self._published:
            self.store.set(f"{_PREFIX}state/{self.rank}", state)
            self._published = state

    def publish(self) -> None:
        """Publish this rank's state now (a failure), if the store still answers. Local."""
        if self.broken is None:
            try:
                self.beat()
            except Exception as err:
                self.broken = f"the heartbeat store stopped answering ({str(err).splitlines()[0]})"

    def halt(self) -> None:
        """Stop the heartbeat thread (it makes no store calls afterwards). Local."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)

    def stop(self, exiting: bool = False) -> None:
        """Stop the thread and let the store go (on rank 0, its server). Local."""
        if exiting and self.monitor.failed and self.rank == self.ranks[0] and self.broken is None:
            # This rank hosts the store: linger so that the peers can read why it failed.
            time.sleep(min(3.0, 3 * self.interval))
        self.halt()
        self.store = None

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if now - last > self.window / 2:
                self._seen.clear()  # this thread did not run for a while: it watched nothing
            last = now
            b = self.monitor.blocked
            waiting = b is not None and self.monitor.verdict is None and now - b[5] >= self.grace
            if self.broken is not None:
                if waiting:  # the store's host is gone: so is whatever this wait needs from it
                    self._decide(b, self.broken)  # type: ignore[arg-type]
                continue
            try:
                self.beat()
                if waiting:
                    self._watch(b)  # type: ignore[arg-type]
            except Exception as err:  # the store's host (rank 0) is gone or frozen: no more store calls
                if self._stop.is_set():
                    return
                self.broken = (
                    f"rank {self.ranks[0]}, which hosts the heartbeat store, stopped answering: it is dead "
                    f"or frozen ({str(err).splitlines()[0]})"
                )

    def _beats(self, peers: list[int], seen: dict[int, tuple[bytes, float]]) -> dict[int, float]:
        """Seconds each peer's heartbeat has not moved, as far as ``seen`` (its value and when it last
        changed, updated here) has watched it."""
        now = time.monotonic()
        values = self.store.multi_get([f"{_PREFIX}hb/{r}" for r in peers])
        for r, v in zip(peers, values, strict=True):
            if r not in seen or seen[r][0] != v:
                seen[r] = (v, now)
        return {r: now - seen[r][1] for r in peers}

    def states(self, peers: list[int]) -> dict[int, dict[str, Any]]:
        raw = self.store.multi_get([f"{_PREFIX}state/{r}" for r in peers])
        return {r: json.loads(v) for r, v in zip(peers, raw, strict=True)}

    def _watch(self, b: Token) -> None:
        peers = [r for r in b[6] if r != self.rank]
        still = self._beats(peers, self._seen)
        dead = [r for r in peers if still[r] >= self.window]
        if dead:
            self._decide(
                b,
                f"rank(s) {dead} are dead: no heartbeat for {self.window:g}s "
                f"({HEARTBEAT_ENV}); a stopped process or a vanished host",
            )
            return
        reason = judge(self.monitor, b, self.states(peers), self.grace)
        if reason is not None:
            self._decide(b, reason)

    def _decide(self, b: Token, reason: str) -> None:
        if self.monitor.blocked is not b:
            return
        self.monitor.verdict = (b, reason)
        if b[7] is not None:
            b[7](next(r for r in b[6] if r != self.rank))

    def explain(self, b: Token, settle: bool) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """Every peer's state and, after a connection error (``settle``), which peers stopped beating:
        a few heartbeats are watched, or until every peer showed a beat or its failure."""
        peers = [r for r in b[6] if r != self.rank]
        notes: list[str] = []
        if self.broken is not None:
            return {}, [self.broken]
        try:
            start = time.monotonic()
            first = self.store.multi_get([f"{_PREFIX}hb/{r}" for r in peers])
            states = self.states(peers)
            quiet = list(peers)
            deadline = start + min(self.window, 3 * self.interval + 0.5) if settle else start
            while quiet and time.monotonic() < deadline:
                time.sleep(self.interval / 2)
                now = self.store.multi_get([f"{_PREFIX}hb/{r}" for r in peers])
                quiet = [r for r, a, z in zip(peers, first, now, strict=True) if a == z]
            if settle and quiet:
                states = self.states(peers)
                notes.append(
                    f"rank(s) {quiet} showed no heartbeat for {time.monotonic() - start:.1f}s after the "
                    "failure: dead (crashed, killed, or exited); their last published state follows"
                )
        except Exception as err:  # the store's host is gone: no more store calls
            self.broken = (
                f"rank {self.ranks[0]}, which hosts the heartbeat store, does not answer: it is presumably "
                f"dead ({str(err).splitlines()[0]})"
            )
            return {}, [self.broken]
        notes += [
            f"rank {r}: {describe(states.get(r))}"
            + (f"; it failed: {states[r]['failed']}" if states.get(r, {}).get("failed") else "")
            for r in peers
        ]
        return states, notes


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


def _same_world(link: _Link) -> bool:
    world = dist.group.WORLD
    ref = link.world
    return (ref() if isinstance(ref, weakref.ref) else ref) is world


def start(comm: Comm) -> None:
    """Start this process's heartbeat for ``comm``'s group (see [Note: liveness]); nothing at world size 1,
    with the heartbeat off, or when ``comm``'s group is not the whole world (its waits keep the timeout).

    Collective: call on all ranks of ``comm``'s group (``initialize`` and ``zero.Init`` do).
    """
    window = heartbeat_window()
    if comm.world_size == 1 or window == 0 or comm.world_size != dist.get_world_size():
        return
    link = MONITOR.link
    if link is not None and _same_world(link):
        return
    if link is not None:
        link.stop()
        MONITOR.link = None
    store: Any = None
    port = 0
    timeout = datetime.timedelta(seconds=max(5.0, window / 2))
    if comm.rank == 0:
        try:
            store = dist.TCPStore(
                "127.0.0.1", 0, comm.world_size, is_master=True, wait_for_workers=False, timeout=timeout
            )
            port = store.port
        except Exception as err:  # no port to listen on: run without a heartbeat
            logger.warning("no heartbeat: rank 0 could not host its store (%s)", err)
    host = socket.gethostname()
    first = comm.all_gather_object((host, port))[0]
    if comm.rank != 0 and first[1]:
        addr = "127.0.0.1" if first[0] == host else os.environ.get("MASTER_ADDR", first[0])
        try:
            store = dist.TCPStore(addr, first[1], comm.world_size, is_master=False, timeout=timeout)
        except Exception as err:
            logger.warning(
                "no heartbeat: rank %d could not reach rank 0's store at %s:%d (%s)",
                comm.rank,
                addr,
                first[1],
                err,
            )
            store = None
    new: _Link | None = None
    if store is not None:
        try:
            world: Any = weakref.ref(dist.group.WORLD)
        except TypeError:
            world = dist.group.WORLD
        ranks = (
            tuple(dist.get_process_group_ranks(comm.group))
            if comm.group is not None
            else tuple(range(comm.world_size))
        )
        new = _Link(MONITOR, store, dist.get_rank(), ranks, window, world)
        try:
            new.beat()
        except Exception:
            new = None
    if min(comm.agree(int(new is not None), what="heartbeat start")) == 0:
        if new is not None:
            new.store = None
        return
    assert new is not None
    MONITOR.restart()
    new.start()
    MONITOR.link = new


def halt() -> None:
    """Stop this process's heartbeat thread, keeping the store (see ``shutdown_distributed``). Local."""
    if MONITOR.link is not None:
        MONITOR.link.halt()


def stop(exiting: bool = False) -> None:
    """Stop this process's heartbeat and close its store (rank 0: the store's server). Local."""
    link, MONITOR.link = MONITOR.link, None
    if link is not None:
        link.stop(exiting)


atexit.register(stop, True)


@contextlib.contextmanager
def collective_api(comm: Comm, name: str, step: int | None = None, check: bool = True) -> Iterator[None]:
    """Mark the block as inside the collective API ``name`` (one of ``APIS``) for the liveness records and,
    with ``check``, first make sure every rank entered it (``Comm.check_entry``). Collective with ``check``:
    call on all ranks."""
    with MONITOR.api(name, step):
        if check:
            comm.check_entry(name, step)
        yield
