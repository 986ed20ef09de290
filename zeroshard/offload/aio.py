"""The NVMe store's I/O engine: a thread pool moving flat tensors to and from one file's descriptors.

Vocabulary: a *region* is a page-aligned byte range of the file; a *request* is one `read` or `write` of a
region and completes through one Future; a *batch* is one `os.preadv`/`os.pwritev` system call of up to
`queue_depth` blocks of `block_size` bytes.

[Note: direct I/O] The file is opened twice, with and without O_DIRECT (a filesystem that refuses O_DIRECT,
such as tmpfs, gets only the buffered descriptor). A batch goes through the direct descriptor when its
buffer address, length and file offset are multiples of `ALIGN`. That holds for buffers from
`NvmeStore.empty` except for a tensor's last partial page, which goes through a page-aligned bounce page,
still direct: every region is padded to whole pages. A buffer that is not aligned falls back to buffered
I/O (through the page cache); Linux keeps the two paths coherent (a direct read first writes back dirty
cached pages, a direct write drops them) as long as a read and a write of one key are never in flight
together, which is the caller's contract.

[Note: queue depth] One batch is one system call of up to `queue_depth * block_size` bytes, given to the
kernel as iovecs of `block_size`. With O_DIRECT the kernel splits it into bios of at most ~1 MiB and submits
them all before waiting, so each pool thread keeps about `queue_depth` device requests in flight, as
DeepSpeed's libaio queue does, without libaio. `intra_op_parallelism` threads issue batches concurrently;
`os.preadv`/`os.pwritev` release the GIL.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGN", "AioEngine", "AioSettings", "IoStats", "Region", "round_up"]

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment in bytes of regions, direct-I/O buffers and lengths (the page size; >= any logical block)."""

_DS_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1}


def round_up(n: int, to: int = ALIGN) -> int:
    """The smallest multiple of `to` that is >= `n`."""
    return -(-n // to) * to


@dataclass(frozen=True)
class AioSettings:
    """How the store splits and schedules I/O (the config's `aio` block).

    The defaults are DeepSpeed's (1 MiB blocks, queue depth 8) except `intra_op_parallelism=2`, chosen with
    `bench/nvme_io.py` (interleaved rounds, 64 MiB tensors) on a 2-core VM with a virtio disk: with one thread
    the device idles while a batch's system call returns and the next is issued, and reads reached 1.3-1.9
    GB/s; two threads overlap that and read 1.5-2.2 GB/s, ahead in every run. Four or eight threads gained
    nothing consistent, writes were disk-bound (~0.6-0.7 GB/s, at or above dd) for every setting, and
    batches above 8 MiB (queue depth 32) were slower, like dd with 64 MiB blocks.

    Invariants: every field is a positive int and `block_size` is a multiple of `ALIGN`, so every block of
    an aligned buffer is itself aligned for O_DIRECT.
    """

    block_size: int = 1_048_576
    """Bytes per I/O block; a tensor is split into blocks of this size."""
    queue_depth: int = 8
    """Blocks one thread has in flight at most: one system call (see [Note: queue depth])."""
    intra_op_parallelism: int = 2
    """Threads in the pool."""

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "intra_op_parallelism"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"aio.{name}={value!r}: expected a positive integer")
        if self.block_size % ALIGN:
            raise ValueError(
                f"aio.block_size={self.block_size}: expected a multiple of {ALIGN} (direct I/O needs "
                f"aligned requests), e.g. {round_up(self.block_size)}"
            )

    @classmethod
    def from_config(cls, aio: Any) -> AioSettings:
        """Settings from zeroshard.config's `AioConfig`; keys the user did not set get this class's defaults.

        A key counts as set when it is in the block's `model_fields_set`, or, for an object without that
        attribute, when its value differs from DeepSpeed's default.
        """
        if aio is None:
            return cls()
        given = getattr(aio, "model_fields_set", None)
        values: dict[str, int] = {}
        for name, ds_default in _DS_DEFAULTS.items():
            value = getattr(aio, name)
            if (name in given) if given is not None else (value != ds_default):
                values[name] = value
        return cls(**values)


@dataclass
class IoStats:
    """Counters of one store; `*_seconds` are wall time during which at least one batch of that kind ran."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    requests: int = 0
    """`read` and `write` calls that moved bytes."""
    syscalls: int = 0
    """Batches (preadv/pwritev calls) completed."""


def _count(stats: IoStats, kind: str, *, nbytes: int = 0, seconds: float = 0.0) -> None:
    """Add to the `kind` ("read" or "write") counters of `stats`; the caller holds the engine's lock."""
    if kind == "write":
        stats.bytes_written += nbytes
        stats.write_seconds += seconds
    else:
        stats.bytes_read += nbytes
        stats.read_seconds += seconds


@dataclass
class Region:
    """A key's byte range of the file: `nbytes` at `offset`, padded to whole pages; never moves."""

    offset: int
    nbytes: int
    written: bool = False
    failed: bool = False
    """Whether the last write failed (set by the engine)."""


_Batch = tuple[int, memoryview, int, bool]
"""(fd, memory, file offset, through a bounce page): one system call."""


class _Request:
    """One read/write: completes `future` when its last batch is done, with the first batch error."""

    def __init__(self, kind: str, key: str, region: Region, tensor: torch.Tensor, pending: int) -> None:
        self.future: Future[None] = Future()
        self.future.set_running_or_notify_cancel()
        self.kind, self.key, self.region = kind, key, region
        self.tensor: torch.Tensor | None = tensor  # kept alive until the last batch is done
        self.pending = pending
        self.error: BaseException | None = None


def _buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bf16 included)."""
    if tensor.nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


class AioEngine:
    """Thread pool and counters over one file's descriptors: all that a batch touches.

    It holds no reference to its `NvmeStore`, so a store is never collected (and finalized) on a pool
    thread. The descriptors belong to the store's `SwapFile`, whose cleanup calls `shutdown` (which joins
    the pool) before closing them, so no batch runs on a closed (or reused) descriptor.
    """

    def __init__(
        self, path: str, fd: int, direct_fd: int | None, *, rank: int, aio: AioSettings, thread_name: str
    ) -> None:
        self.path, self.fd, self.direct_fd = path, fd, direct_fd
        self.rank, self.aio = rank, aio
        self.use_direct = True
        self.pool: ThreadPoolExecutor | None = ThreadPoolExecutor(aio.intra_op_parallelism, thread_name)
        self.stats = IoStats()
        self.lock = threading.Lock()  # stats, busy counters, outstanding, first_error, request counters
        self.outstanding: set[Future[None]] = set()
        self.first_error: RuntimeError | None = None
        self._running = {"read": 0, "write": 0}
        self._busy_since = {"read": 0.0, "write": 0.0}

    @property
    def direct_io(self) -> bool:
        """Whether aligned buffers go through O_DIRECT (False on a filesystem that refuses it)."""
        return self.direct_fd is not None and self.use_direct

    def submit(self, kind: str, key: str, region: Region, tensor: torch.Tensor) -> Future[None]:
        """Start moving `tensor`'s bytes to (`kind="write"`) or from (`"read"`) `region`."""
        if self.pool is None:
            raise RuntimeError(f"rank {self.rank}: the NVMe store {self.path} is closed")
        batches = list(self._batches(region.offset, _buffer(tensor), tensor.data_ptr()))
        request = _Request(kind, key, region, tensor, len(batches))
        if not batches:
            request.future.set_result(None)
            return request.future
        with self.lock:
            self.outstanding.add(request.future)
            self.stats.requests += 1
        for fd, mv, offset, bounce in batches:
            try:
                fut = self.pool.submit(self._run, kind, fd, mv, offset, bounce)
            except RuntimeError as e:  # the pool was shut down under us: fail the batch, do not hang
                fut = Future()
                fut.set_exception(e)
            fut.add_done_callback(functools.partial(self._batch_done, request))
        return request.future

    def _batches(self, offset: int, buf: memoryview, address: int) -> Iterator[_Batch]:
        """The system calls of one request; see [Note: direct I/O]."""
        n, step = len(buf), self.aio.block_size * self.aio.queue_depth
        direct = self.direct_fd
        if direct is None or not self.use_direct or address % ALIGN:
            for start in range(0, n, step):
                yield self.fd, buf[start : start + step], offset + start, False
            return
        body = n - n % ALIGN
        for start in range(0, body, step):
            yield direct, buf[start : min(start + step, body)], offset + start, False
        if body < n:
            yield direct, buf[body:], offset + body, True

    def _run(self, kind: str, fd: int, mv: memoryview, offset: int, bounce: bool) -> None:
        self._busy(kind, +1)
        try:
            if not bounce:
                self._transfer(kind, fd, mv, offset)
            else:
                # Anonymous mmaps are page-aligned. Not closed explicitly: a traceback may still hold a
                # view of it; the last reference unmaps it.
                page = memoryview(mmap.mmap(-1, ALIGN))
                if kind == "write":
                    page[: len(mv)] = mv
                self._transfer(kind, fd, page, offset)
                if kind == "read":
                    mv[:] = page[: len(mv)]
            with self.lock:
                self.stats.syscalls += 1
                _count(self.stats, kind, nbytes=len(mv))
        finally:
            self._busy(kind, -1)

    def _transfer(self, kind: str, fd: int, mv: memoryview, offset: int) -> None:
        """Move all of `mv` at `offset`, resuming after short transfers; EINVAL from O_DIRECT -> buffered."""
        call = os.pwritev if kind == "write" else os.preadv
        bs, done = self.aio.block_size, 0
        while done < len(mv):
            rest = mv[done:]
            try:
                n = call(fd, [rest[i : i + bs] for i in range(0, len(rest), bs)], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL or fd == self.fd:
                    raise
                with self.lock:
                    first, self.use_direct, fd = self.use_direct, False, self.fd
                if first:
                    logger.warning("rank %d: O_DIRECT %s on %s failed: %s; using buffered I/O from now on",
                                   self.rank, kind, self.path, os.strerror(e.errno))  # fmt: skip
                continue
            if n <= 0:
                raise OSError(errno.EIO, f"{kind} moved {n} bytes at offset {offset + done} of {self.path}")
            done += n

    def _busy(self, kind: str, delta: int) -> None:
        """Count batches running; add to `<kind>_seconds` the spans during which any ran."""
        now = time.perf_counter()
        with self.lock:
            if self._running[kind] == 0:
                self._busy_since[kind] = now
            self._running[kind] += delta
            if self._running[kind] == 0:
                _count(self.stats, kind, seconds=now - self._busy_since[kind])

    def _batch_done(self, request: _Request, fut: Future[None]) -> None:
        err = RuntimeError("the store was closed first") if fut.cancelled() else fut.exception()
        with self.lock:
            if err is not None and request.error is None:
                request.error = err
            request.pending -= 1
            if request.pending:
                return
            self.outstanding.discard(request.future)
            if request.error is None:
                wrapped = None
            else:
                region = request.region
                wrapped = RuntimeError(
                    f"rank {self.rank}: NVMe {request.kind} of key {request.key!r} failed on {self.path} "
                    f"(region at offset {region.offset}, {region.nbytes} bytes): {request.error!r}"
                )
                wrapped.__cause__ = request.error
                region.failed = region.failed or request.kind == "write"
                self.first_error = self.first_error or wrapped
        request.tensor = None  # drop the caller's tensor before its future completes
        if wrapped is None:
            request.future.set_result(None)
        else:
            request.future.set_exception(wrapped)

    def wait(self, timeout_s: float) -> None:
        """Wait for every outstanding request; re-raise the first error since the last call."""
        with self.lock:
            pending = list(self.outstanding)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout_s)
        if not_done:
            raise RuntimeError(
                f"rank {self.rank}: {len(not_done)} NVMe requests on {self.path} still running after "
                f"{timeout_s} s"
            )
        with self.lock:
            error, self.first_error = self.first_error, None
        if error is not None:
            raise RuntimeError(str(error)) from error.__cause__

    def shutdown(self) -> None:
        """Join the pool (cancelling batches not started); later `submit` calls raise. Idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
