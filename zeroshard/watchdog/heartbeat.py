"""The heartbeat of [Note: liveness] (monitor.py): rank 0's store and a thread per process.

``start`` (collective, from ``initialize`` and ``zero.Init``) shares the port of a ``TCPStore`` rank 0
hosts; every process's daemon thread then bumps its counter there every ``interval`` and publishes its
monitor's state when it changed, and, only while a wait has lasted the grace, reads its peers, decides
why the wait cannot complete (``verdicts.judge``) and breaks it. The heartbeats started are listed here
(one per world: a new world stops the previous one's), so that ``halt_all`` and ``stop_all`` end them (at
``shutdown_distributed`` and at exit) and ``monitor_for_world`` finds the monitor a heartbeat watches.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist

from zeroshard.core.comm import Comm
from zeroshard.watchdog.monitor import LivenessMonitor
from zeroshard.watchdog.verdicts import Token, describe, judge

logger = logging.getLogger(__name__)
# torch.distributed re-exports the store class without listing it in __all__.
_TCPStore = dist.TCPStore  # type: ignore[attr-defined]

HEARTBEAT_ENV = "ZEROSHARD_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_S = 30.0
_PREFIX = "zeroshard/liveness/"


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


class Link:
    """The store and heartbeat thread of one world, watching one monitor (see [Note: liveness])."""

    def __init__(
        self,
        monitor: LivenessMonitor,
        store: Any,
        rank: int,
        ranks: tuple[int, ...],
        window: float,
        world: Any,
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
        # A store call does not return while rank 0 is stopped: a second thread watches the first.
        self._busy_since: float | None = None
        self._guard = threading.Thread(
            target=self._watch_store, name="zeroshard-heartbeat-guard", daemon=True
        )

    def start(self) -> None:
        self.beat()
        self._thread.start()
        self._guard.start()

    def responsive(self) -> bool:
        """Whether a store call can be made without waiting on a stopped rank 0."""
        busy = self._busy_since
        return self.broken is None and (busy is None or time.monotonic() - busy < 2.0)

    def _watch_store(self) -> None:
        patience = max(5.0, self.window / 2)
        while not self._stop.wait(self.interval):
            busy = self._busy_since
            if busy is None or time.monotonic() - busy < patience:
                continue
            if self.broken is None:
                self.broken = (
                    f"rank {self.ranks[0]}, which hosts the heartbeat store, has not answered for "
                    f"{time.monotonic() - busy:.0f}s: it is stopped or its host vanished"
                )
            b = self.monitor.blocked
            if b is not None and self.monitor.verdict is None and time.monotonic() - b[5] >= self.grace:
                self._decide(b, self.broken)

    def beat(self) -> None:
        self.store.add(f"{_PREFIX}hb/{self.rank}", 1)
        state = json.dumps(self.monitor.snapshot(time.monotonic()), default=str)
        if state != self._published:
            self.store.set(f"{_PREFIX}state/{self.rank}", state)
            self._published = state

    def publish(self) -> None:
        """Publish this rank's state now (a failure), if the store still answers. Local."""
        if self.responsive():
            try:
                self.beat()
            except Exception as err:
                self.broken = f"the heartbeat store stopped answering ({str(err).splitlines()[0]})"

    def halt(self) -> None:
        """Stop the heartbeat thread (it makes no store calls afterwards). Local."""
        self._stop.set()
        for thread in (self._thread, self._guard):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout=2 * self.interval + 1)

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
                self._busy_since = time.monotonic()
                self.beat()
                if waiting:
                    self._watch(b)  # type: ignore[arg-type]
                self._busy_since = None
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
        if not self.responsive():
            return {}, [self.broken or f"the heartbeat store on rank {self.ranks[0]} is not answering"]
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


# The heartbeats this process started and has not stopped: at most one per world (``start`` stops the
# others). Only ``start``, ``stop_all`` and ``monitor_for_world`` read or write it.
_STARTED: list[Link] = []


def _same_world(link: Link) -> bool:
    world = dist.group.WORLD
    ref = link.world
    return (ref() if isinstance(ref, weakref.ref) else ref) is world


def monitor_for_world() -> LivenessMonitor:
    """The monitor for a new ``Comm``: the one the heartbeat running on this world watches, so that every
    engine of the process is watched, else a new one. Local."""
    if dist.is_available() and dist.is_initialized():
        for link in _STARTED:
            if _same_world(link):
                return link.monitor
    return LivenessMonitor()


def start(comm: Comm) -> None:
    """Start a heartbeat watching ``comm.monitor`` (see [Note: liveness]); nothing at world size 1, with the
    heartbeat off, when ``comm``'s group is not the whole world (its waits keep the timeout), when its
    monitor is not a :class:`LivenessMonitor`, or when a heartbeat already watches this world.

    Collective: call on all ranks of ``comm``'s group (``initialize`` and ``zero.Init`` do).
    """
    window = heartbeat_window()
    if comm.world_size == 1 or window == 0 or comm.world_size != dist.get_world_size():
        return
    monitor = comm.monitor
    if not isinstance(monitor, LivenessMonitor) or any(_same_world(link) for link in _STARTED):
        return
    stop_all()  # a previous world's
    new = _connect(comm, monitor, window)
    if min(comm.agree(int(new is not None), what="heartbeat start")) == 0:
        if new is not None:
            new.store = None
        return
    assert new is not None
    monitor.restart()
    new.start()
    monitor.link = new
    _STARTED.append(new)


def _connect(comm: Comm, monitor: LivenessMonitor, window: float) -> Link | None:
    """The link to rank 0's store, with a first beat made; None where this rank has no store. Collective:
    call on all ranks of ``comm``'s group (rank 0 shares its store's port)."""
    store: Any = None
    port = 0
    timeout = datetime.timedelta(seconds=max(5.0, window / 2))
    if comm.rank == 0:
        try:
            store = _TCPStore(
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
            store = _TCPStore(addr, first[1], comm.world_size, is_master=False, timeout=timeout)
        except Exception as err:
            logger.warning(
                "no heartbeat: rank %d could not reach rank 0's store at %s:%d (%s)",
                comm.rank,
                addr,
                first[1],
                err,
            )
            store = None
    if store is None:
        return None
    try:
        world: Any = weakref.ref(dist.group.WORLD)
    except TypeError:
        world = dist.group.WORLD
    group = comm.group
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(comm.world_size))
    link = Link(monitor, store, dist.get_rank(), ranks, window, world)
    try:
        link.beat()
    except Exception:
        return None
    return link


def halt_all() -> None:
    """Stop the heartbeat threads, keeping their stores (see ``shutdown_distributed``). Local."""
    for link in _STARTED:
        link.halt()


def stop_all(exiting: bool = False) -> None:
    """Stop the heartbeats and close their stores (rank 0: the stores' servers). Local."""
    while _STARTED:
        link = _STARTED.pop()
        link.monitor.link = None
        link.stop(exiting)


atexit.register(stop_all, True)
