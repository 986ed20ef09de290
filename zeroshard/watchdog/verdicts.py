"""Reading the peers' published states: what a rank is doing in words (``describe``), why a wait cannot
complete (``judge``), and the last-collectives table every ``CollectiveError`` carries
(see [Note: liveness] in monitor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from zeroshard.core.liveness import STAGE3_ADVICE

RING = 16  # collectives each rank remembers
SHOWN = 6  # of which the error's table shows the newest

# A wait in progress: (group key, sequence number, what, api, step, since, global ranks of the group, a
# function that makes the wait raise when given a peer's global rank, or None, whether it is a direct
# exchange: point-to-point messages tagged with what they carry, see comm.py [Note: direct exchange])
Token = tuple[str, int, str, str, "int | None", float, tuple[int, ...], "Callable[[int], None] | None", bool]


class Records(Protocol):
    """What :func:`judge` reads of this rank's ``LivenessMonitor``."""

    seq: dict[str, int]

    def ring_copy(self) -> list[tuple[str, int, str, str, int | None]]: ...


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


def judge(monitor: Records, b: Token, states: dict[int, dict[str, Any]], grace: float) -> str | None:
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
