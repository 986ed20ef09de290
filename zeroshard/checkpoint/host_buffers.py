"""Host memory an asynchronous save copies into, kept from one save to the next.

[Note: host snapshot buffers]
``save_checkpoint(async_save=True)`` blocks the training loop while it copies this rank's shards to host
memory ([Note: async save], step 1). Copying into freshly allocated memory costs mostly page faults: on a
CPU machine a copy of 1 GB into new pages took ~6x as long as the same copy into pages touched before.
So the writer keeps one flat buffer per kind of file (the shard; rank 0's extra file) and copies into views
of it:

* The first save allocates the buffer (one allocation: the tensors lie back to back, each at an offset
  aligned to ``ALIGN`` bytes) and pays the page faults; a later save whose tensors have the same dtypes
  and shapes copies into the same pages, with no allocation and no page faults.
* Tensors of another layout (the first step created the optimizer state, a client-state tensor changed
  shape) free the buffer before allocating the new one, so at most one copy is held.
* A buffer is reused only once the write that read it has finished: :meth:`HostBuffers.copy` waits for the
  future of the previous write it was handed (the next save already waited for it in ``finish_pending``,
  so this costs nothing but guards the invariant). :meth:`HostBuffers.release` drops the buffer (at
  ``close``); a write still running keeps its views, and so its memory, alive until it ends.
* Sources on a CUDA device are copied into pinned memory without blocking, then the devices are
  synchronized once, before the copy returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64  # bytes; a multiple of every dtype's item size, so each view can take its dtype

Layout = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostBuffers:
    """One flat host buffer holding copies of a list of tensors, reused while their layout stays the same.

    Invariants: ``views`` are views of ``buffer`` laid out as ``layout``; the buffer is written only when
    the future passed with the previous copy is done.
    """

    def __init__(self) -> None:
        self.layout: Layout = ()
        self.pinned = False
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.allocations = 0  # how many buffers were allocated (tests and the benchmark read it)
        self._reader: Future[Any] | None = None

    def copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` in host memory that training cannot change: views of the kept buffer.

        The caller passes them to one write and then :meth:`lend` s the write's future: the views are
        overwritten by the next ``copy`` once that future is done, never before.
        """
        if self._reader is not None:
            wait_for([self._reader])
            self._reader = None
        layout = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        on_cuda = [t.device for t in tensors if t.device.type == "cuda"]
        pinned = bool(on_cuda) and torch.cuda.is_available()
        if self.buffer is None or layout != self.layout or pinned != self.pinned:
            self._allocate(layout, pinned)
        for view, tensor in zip(self.views, tensors, strict=True):
            view.copy_(tensor.detach(), non_blocking=pinned)
        for device in set(on_cuda):
            torch.cuda.synchronize(device)
        return list(self.views)

    def lend(self, reader: Future[Any]) -> None:
        """Record that the write whose result is ``reader`` reads the views (see :meth:`copy`)."""
        self._reader = reader

    def release(self) -> None:
        """Drop the buffer (a write still reading it keeps its views alive until it ends)."""
        self.buffer, self.views, self.layout, self._reader = None, [], (), None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def _allocate(self, layout: Layout, pinned: bool) -> None:
        self.release()  # before the new one: at most one buffer is held
        offsets, total = [], 0
        for dtype, shape in layout:
            offsets.append(total)
            total += _aligned(_numel(shape) * dtype.itemsize)
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
        self.views = [
            buffer[off : off + _numel(shape) * dtype.itemsize].view(dtype).view(shape)
            for off, (dtype, shape) in zip(offsets, layout, strict=True)
        ]
        self.buffer, self.layout, self.pinned = buffer, layout, pinned
        self.allocations += 1


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass
class SnapshotBuffers:
    """A writer's buffers: this rank's shard file, and rank 0's extra file (frozen parameters, buffers,
    RNG states, client tensors), apart so that a client tensor changing shape leaves the shard's in place."""

    shard: HostBuffers = field(default_factory=HostBuffers)
    extra: HostBuffers = field(default_factory=HostBuffers)

    def lend(self, reader: Future[Any]) -> None:
        self.shard.lend(reader)
        self.extra.lend(reader)

    def release(self) -> None:
        self.shard.release()
        self.extra.release()
