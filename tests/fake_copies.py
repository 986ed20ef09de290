"""A stand-in for a GPU's copy stream on a CPU machine ([Note: copy streams] in zeroshard/core/copies.py).

:class:`DeferredCopies` lands a copy only when it is waited for, and fills a floating-point destination with
NaN until then. So on a CPU, code that reads a destination before waiting for its copy reads NaN, and a copy
never waited for never lands. It reads the source either when the copy is waited for (``read_source=
"wait"``: code that writes a source before then copies the new values) or when it starts (``"start"``: code
that takes a copy and then changes the source without copying again keeps the old values). Each is a wrong
number that a parity test sees, where a real copy stream would race only now and then.

:func:`simulate_offload_device` makes zeroshard treat the CPU as a device beside host memory, with these
copies, so that the offload paths meant for a GPU run on a CPU.
"""

from __future__ import annotations

import pytest
import torch

from zeroshard.core.copies import Copy


class _Deferred:
    def __init__(self, owner: DeferredCopies, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._owner = owner
        self._dst: torch.Tensor | None = dst
        self._src = src.clone() if owner.read_source == "start" else src

    def wait(self) -> None:
        if self._dst is not None:
            self._dst.copy_(self._src)
            self._dst = None
            self._owner.landed += 1

    def wait_on_device(self) -> None:
        self.wait()


class DeferredCopies:
    """Copies that happen when waited for; the destination reads NaN until then."""

    def __init__(self, read_source: str = "wait") -> None:
        self.read_source = read_source
        self.started = 0
        self.landed = 0

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        if dst.numel() != src.numel() or dst.dtype != src.dtype:
            raise AssertionError(f"copy of {src.dtype}[{src.numel()}] into {dst.dtype}[{dst.numel()}]")
        if dst.is_floating_point():
            dst.fill_(float("nan"))
        self.started += 1
        return _Deferred(self, dst, src)

    def take_times(self) -> dict[str, float]:
        return {}


def simulate_offload_device(
    monkeypatch: pytest.MonkeyPatch | None = None, read_source: str = "wait"
) -> list[DeferredCopies]:
    """Make the offload set-up treat the CPU as a device beside host memory, with deferred copies.

    Returns the list that each engine's :class:`DeferredCopies` is appended to as it is built. Without
    ``monkeypatch`` (in a spawned worker) the patch stays for the process's life.
    """
    import zeroshard.offload.setup as setup

    made: list[DeferredCopies] = []

    def copies_for(device: torch.device) -> DeferredCopies:
        made.append(DeferredCopies(read_source))
        return made[-1]

    if monkeypatch is not None:
        monkeypatch.setattr(setup, "host_copies_for", copies_for)
    else:
        setup.host_copies_for = copies_for  # type: ignore[assignment]
    return made
