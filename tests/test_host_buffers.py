"""HostBuffers: the host copies of an asynchronous save, kept from one save to the next (no processes)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from zeroshard.checkpoint.host_buffers import ALIGN, HostBuffers, SnapshotBuffers


def _tensors() -> list[torch.Tensor]:
    """Mixed dtypes and shapes: odd sizes, a scalar, an empty tensor, a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(7, generator=g),
        torch.tensor(3.0),  # Adam's step
        torch.randn(15, generator=g, dtype=torch.float64),
        torch.randn(3, 5, generator=g).t(),  # not contiguous
        torch.empty(0),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int64),
    ]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_copies_are_equal_and_independent_of_the_sources() -> None:
    sources = _tensors()
    truth = [t.clone() for t in sources]
    buffers = HostBuffers()
    copies = buffers.copy(sources)
    _equal(copies, truth)
    for t in sources:
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    _equal(copies, truth)
    assert all(c.is_contiguous() for c in copies)
    offsets = [c.data_ptr() - buffers.views[0].data_ptr() for c in copies if c.numel()]
    assert all(off % ALIGN == 0 for off in offsets)


def test_the_same_layout_reuses_the_buffer() -> None:
    sources = _tensors()
    buffers = HostBuffers()
    buffers.copy(sources)
    first = buffers.buffer
    assert first is not None
    for t in sources:
        if t.is_floating_point():
            t.add_(1)
    again = buffers.copy(sources)
    assert buffers.buffer is first and buffers.allocations == 1
    _equal(again, [t.clone() for t in sources])


def test_another_layout_replaces_the_buffer_and_release_drops_it() -> None:
    buffers = HostBuffers()
    buffers.copy([torch.ones(10)])
    copies = buffers.copy([torch.ones(10), torch.zeros(3, dtype=torch.float16)])
    assert buffers.allocations == 2 and len(copies) == 2
    assert buffers.nbytes == 2 * ALIGN
    buffers.copy([torch.ones(10, dtype=torch.float64)])  # same count, another dtype
    assert buffers.allocations == 3
    buffers.release()
    assert buffers.buffer is None and buffers.nbytes == 0 and buffers.views == []
    buffers.copy([torch.ones(10, dtype=torch.float64)])
    assert buffers.allocations == 4


def test_a_copy_waits_for_the_write_reading_the_buffer() -> None:
    buffers = HostBuffers()
    copies = buffers.copy([torch.zeros(4)])
    reader: Future[Any] = Future()
    buffers.lend(reader)
    seen: list[torch.Tensor] = []

    def write() -> None:  # the background write: reads the copy, then completes its future
        time.sleep(0.3)
        seen.append(copies[0].clone())
        reader.set_exception(OSError("a failed write frees the buffer too"))

    thread = threading.Thread(target=write)
    thread.start()
    buffers.copy([torch.ones(4)])
    thread.join()
    assert torch.equal(seen[0], torch.zeros(4))  # the write read what it was given
    assert torch.equal(copies[0], torch.ones(4)) and buffers.allocations == 1


def test_snapshot_buffers_lend_and_release_both() -> None:
    host = SnapshotBuffers()
    host.shard.copy([torch.ones(3)])
    host.extra.copy([torch.ones(2)])
    reader: Future[Any] = Future()
    host.lend(reader)
    reader.set_result({})
    host.release()
    assert host.shard.buffer is None and host.extra.buffer is None
