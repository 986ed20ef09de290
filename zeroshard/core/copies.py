"""Copies between host memory and the training device that run beside the computation.

[Note: copy streams]
ZeRO-Offload moves gradient shards to the CPU during the backward and stepped parameter shards back
during the CPU step; ``offload_param`` moves each parameter shard to the GPU ahead of its gather. Each such
copy is started with :meth:`Copies.start`, which orders it after the work already queued on the compute
stream (so a source the model just produced is complete) and returns a :class:`Copy`. Until that copy is
waited for, nothing may read its destination or write its source:

* :meth:`Copy.wait`: the host waits; afterwards the host may read the destination and reuse the source.
* :meth:`Copy.wait_on_device`: the compute stream waits (kernels queued afterwards read the destination);
  the host does not, so the source stays busy until :meth:`Copy.wait`.

A device tensor a copy reads or writes may be dropped as soon as the copy has started: its memory is not
handed out again until the copy is done (``record_stream``). So a gradient shard moved to the CPU, or a
cast made for a copy, leaves GPU memory without a host wait.

:class:`StreamCopies` (CUDA) runs the copies on one side stream per device, concurrently with the kernels
and collectives of the compute stream, ordered by events. :class:`InlineCopies` copies at once, for a
device that is host memory itself. Tests use an implementation that copies only when a copy is waited for
and poisons the destination until then (``tests/fake_copies.py``), so that a missing or misplaced wait
shows as a wrong value on a CPU instead of a rare race on a GPU.

Local: no collectives.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Copy(Protocol):
    """One started copy ([Note: copy streams])."""

    def wait(self) -> None:
        """Block the host until the copy is done: its destination may be read, its source reused."""
        ...

    def wait_on_device(self) -> None:
        """Make the compute stream wait for the copy: kernels queued from now on see the destination."""
        ...


class Copies(Protocol):
    """Starts copies between host memory and the training device ([Note: copy streams])."""

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """Start ``dst.copy_(src)`` after the work already queued on the compute stream. ``dst`` and ``src``
        have the same number of elements and the same dtype; a host tensor should be pinned."""
        ...

    def take_times(self) -> dict[str, float]:
        """Seconds the copies finished since the last call spent copying, by direction (``d2h_s``,
        ``h2d_s``); empty where copies are not timed."""
        ...


class _Done:
    def wait(self) -> None:
        return None

    def wait_on_device(self) -> None:
        return None


class InlineCopies:
    """Copies at once: the training device is host memory (nothing to overlap with)."""

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        dst.copy_(src)
        return _Done()

    def take_times(self) -> dict[str, float]:
        return {}


class _StreamCopy:
    def __init__(self, event: torch.cuda.Event, device: torch.device, tensors: tuple[torch.Tensor, ...]):
        self._event = event
        self._device = device
        self._tensors: tuple[torch.Tensor, ...] = tensors  # host tensors, alive until the host waits

    def wait(self) -> None:
        self._event.synchronize()
        self._tensors = ()

    def wait_on_device(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class StreamCopies:
    """Copies on a side stream of one CUDA device, beside the compute stream ([Note: copy streams])."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # direction, start, end
        self._times = {"d2h_s": 0.0, "h2d_s": 0.0}  # of the finished copies no take_times has reported

    def start(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        begin = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                # The caching allocator must not hand this memory to the compute stream while the copy
                # still reads or writes it.
                t.record_stream(self.stream)
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        self._timed.append(("h2d_s" if dst.is_cuda else "d2h_s", begin, event))
        if len(self._timed) >= 256:
            self._collect()  # hold events of copies in flight only
        # Host tensors stay referenced until the host waits; device memory is safe through record_stream
        # and goes as soon as the caller drops it (a gradient shard that moved to the CPU, a cast).
        return _StreamCopy(event, self.device, tuple(t for t in (dst, src) if not t.is_cuda))

    def _collect(self) -> None:
        pending = []
        for direction, begin, end in self._timed:
            if end.query():
                self._times[direction] += begin.elapsed_time(end) / 1e3
            else:
                pending.append((direction, begin, end))
        self._timed = pending

    def take_times(self) -> dict[str, float]:
        self._collect()
        out, self._times = self._times, {"d2h_s": 0.0, "h2d_s": 0.0}
        return out


def copies_between_host_and(device: torch.device) -> Copies:
    """The copies for ``device``: a side stream for a CUDA device, inline copies for the CPU."""
    return StreamCopies(device) if device.type == "cuda" else InlineCopies()
