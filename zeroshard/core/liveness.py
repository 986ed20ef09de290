"""What core tells the liveness records: the :class:`Monitor` a :class:`~zeroshard.core.comm.Comm` reports
its collectives and waits to, the collective APIs, and :class:`CollectiveError`.

The records themselves (the ring of last collectives, the heartbeat, the judgement of a stuck wait) are
``zeroshard/watchdog/`` ([Note: liveness] in ``zeroshard/watchdog/monitor.py``): ``initialize`` and
``zero.Init`` create a monitor there and hand it to their ``Comm``. A ``Comm`` built without one gets a
:class:`NullMonitor`: its waits are still bounded by the timeout and raise :class:`CollectiveError`, without
the other ranks' states.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

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


class Monitor(Protocol):
    """What :class:`~zeroshard.core.comm.Comm` and :class:`~zeroshard.core.pending.Pending` tell the liveness
    records (``zeroshard.watchdog.LivenessMonitor``; :class:`NullMonitor` keeps none). Only the calling
    thread calls these; none communicates."""

    @property
    def watched(self) -> bool:
        """Whether a heartbeat watches this monitor's waits (see ``Comm.watched``)."""
        ...

    def note(self, key: str, op: str, what: str) -> int:
        """Count a collective launched on the group named ``key``; returns its sequence number there."""
        ...

    def api(self, name: str, step: int | None = None) -> AbstractContextManager[None]:
        """``with monitor.api(name, step):`` marks the block as inside the collective API ``name``."""
        ...

    def block(
        self,
        key: str,
        seq: int,
        what: str,
        ranks: tuple[int, ...],
        breaker: Callable[[int], None] | None,
        exchange: bool = False,
    ) -> Any:
        """This thread now waits on collective #``seq`` of group ``key`` (global ``ranks``); ``breaker``
        makes the wait raise, ``exchange`` says it is a direct exchange (comm.py [Note: direct exchange]).
        Returns the token :meth:`unblock` and :meth:`failure` take."""
        ...

    def unblock(self, token: Any) -> None:
        """The wait ``token`` is over."""
        ...

    def failure(
        self, token: Any, err: BaseException, rank: int, timeout: datetime.timedelta | None, waited: float
    ) -> CollectiveError:
        """The error the wait ``token`` raises, failed with ``err`` (or timed out) after ``waited`` s."""
        ...


class NullMonitor:
    """The monitor of a ``Comm`` built without one: keeps no records; a failed wait names the rank and the
    collective only."""

    watched = False

    def note(self, key: str, op: str, what: str) -> int:
        return 0

    def api(self, name: str, step: int | None = None) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def block(
        self,
        key: str,
        seq: int,
        what: str,
        ranks: tuple[int, ...],
        breaker: Callable[[int], None] | None,
        exchange: bool = False,
    ) -> Any:
        return what

    def unblock(self, token: Any) -> None:
        pass

    def failure(
        self, token: Any, err: BaseException, rank: int, timeout: datetime.timedelta | None, waited: float
    ) -> CollectiveError:
        if timeout is not None and waited >= 0.95 * timeout.total_seconds():
            return CollectiveError(f"rank {rank}: {token} did not complete within {timeout} ({TIMEOUT_HINT})")
        return CollectiveError(f"rank {rank}: {token} failed: {err}")


class _Entered(Protocol):
    """What :func:`collective_api` uses of ``zeroshard.core.comm.Comm``."""

    @property
    def monitor(self) -> Monitor: ...

    def check_entry(self, api: str, step: int | None) -> None: ...


@contextlib.contextmanager
def collective_api(comm: _Entered, name: str, step: int | None = None, check: bool = True) -> Iterator[None]:
    """Mark the block as inside the collective API ``name`` (one of ``APIS``) in ``comm``'s monitor and,
    with ``check``, first make sure every rank entered it (``Comm.check_entry``). Collective with ``check``:
    call on all ranks."""
    with comm.monitor.api(name, step):
        if check:
            comm.check_entry(name, step)
        yield


def entry_mismatch(api: str, rows: list[list[int]], rank: int) -> CollectiveError | None:
    """The error when not every rank entered ``api``: ``rows`` holds each rank's (API code in :data:`APIS`,
    step or -1), as ``Comm.check_entry`` gathered them. None when they all did."""
    code = APIS.index(api)
    if all(row[0] == code for row in rows):
        return None
    by_api: dict[str, list[int]] = {}
    for r, row in enumerate(rows):
        name = APIS[row[0]] if 0 <= row[0] < len(APIS) else f"API #{row[0]}"
        by_api.setdefault(f"{name} (step {row[1]})" if row[1] >= 0 else name, []).append(r)
    sides = "; ".join(f"ranks {ranks} entered {name}" for name, ranks in by_api.items())
    return CollectiveError(
        f"rank {rank}: the ranks called different collective APIs: {sides}. {api} is collective: "
        "call it on every rank (not under `if rank == 0:`), in the same order as the other collective "
        "calls"
    )
