"""The NVMe swap store: one rank's named flat tensors in one preallocated file (ZeRO-Infinity's tier).

Vocabulary: a *key* names one flat tensor; its *region* is a page-aligned byte range of the file, fixed at
first `reserve`/`write`; a *request* is one `read` or `write` call and completes through one Future; a
*batch* is one `os.preadv`/`os.pwritev` system call of up to `queue_depth` blocks of `block_size` bytes.

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
import fcntl
import functools
import logging
import mmap
import os
import re
import shutil
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGN", "AioSettings", "IoStats", "NvmeStore"]

logger = logging.getLogger(__name__)

ALIGN = 4096
"""Alignment in bytes of regions, direct-I/O buffers and lengths (the page size; >= any logical block)."""

_DS_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1}
_PURPOSE = re.compile(r"^[A-Za-z0-9_.-]+$")


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB ({n} bytes)"


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
                f"aligned requests), e.g. {_round_up(self.block_size)}"
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


@dataclass
class _Region:
    offset: int
    nbytes: int
    written: bool = False
    failed: bool = False


_Batch = tuple[int, memoryview, int, bool]
"""(fd, memory, file offset, through a bounce page): one system call."""


class _Request:
    """One read/write: completes `future` when its last batch is done, with the first batch error."""

    def __init__(self, kind: str, key: str, region: _Region, tensor: torch.Tensor, pending: int) -> None:
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


class _Engine:
    """Descriptors, thread pool and counters: all that a batch touches.

    It holds no reference to its `NvmeStore`, so a store is never collected (and finalized) on a pool
    thread. Invariant: `cleanup` joins the pool before closing descriptors, so no batch runs on a closed
    (or reused) descriptor.
    """

    def __init__(self, path: str, lock_fd: int, rank: int, aio: AioSettings) -> None:
        self.path, self.lock_path, self.lock_fd = path, path + ".lock", lock_fd
        self.rank, self.aio = rank, aio
        self.owner_pid = os.getpid()  # a forked child that exits must not delete its parent's files
        self.fd = -1
        self.direct_fd: int | None = None
        self.use_direct = True
        self.pool: ThreadPoolExecutor | None = None
        self.stats = IoStats()
        self.lock = threading.Lock()  # stats, busy counters, outstanding, first_error, request counters
        self.outstanding: set[Future[None]] = set()
        self.first_error: RuntimeError | None = None
        self._running = {"read": 0, "write": 0}
        self._busy_since = {"read": 0.0, "write": 0.0}

    def submit(self, kind: str, key: str, region: _Region, tensor: torch.Tensor) -> Future[None]:
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
                if kind == "write":
                    self.stats.bytes_written += len(mv)
                else:
                    self.stats.bytes_read += len(mv)
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
                span = now - self._busy_since[kind]
                if kind == "write":
                    self.stats.write_seconds += span
                else:
                    self.stats.read_seconds += span

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

    def cleanup(self) -> None:
        """Join the pool, close the descriptors, delete the file, then the lock file, then drop the lock.

        In a forked child only the inherited descriptors are closed: the files are the parent's.
        """
        if os.getpid() != self.owner_pid:
            for fd in (self.direct_fd, self.fd, self.lock_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            return
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self.direct_fd, self.fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.direct_fd, self.fd = None, -1
        for p in (self.path, self.lock_path):  # the lock file last, while we still hold its flock
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        os.close(self.lock_fd)


# --- start-up checks ----------------------------------------------------------------------------------------


def _check_directory(directory: str, config_key: str) -> None:
    if not os.path.exists(directory):
        raise ValueError(
            f"{config_key}={directory!r}: the directory does not exist; create it (mkdir -p) or point "
            f"{config_key} at an existing directory on a local NVMe disk"
        )
    if not os.path.isdir(directory):
        raise ValueError(
            f"{config_key}={directory!r}: is a file, not a directory; point {config_key} at a directory on a "
            "local NVMe disk"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(
            f"{config_key}={directory!r}: the directory is not writable by this process (uid "
            f"{os.geteuid()}); fix its permissions or point {config_key} at a writable directory"
        )


def _free_bytes(directory: str) -> int:
    return shutil.disk_usage(directory).free


def _check_space(directory: str, needed: int, config_key: str, what: str) -> None:
    free = _free_bytes(directory)
    if free < needed:
        raise ValueError(
            f"{config_key}={directory!r}: needs {_gb(needed)} {what}, {_gb(free)} free on {directory}; "
            f"free some space or point {config_key} at a larger disk"
        )


def _lock_owner(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            pid, _, host = f.read().strip().partition(" ")
    except OSError:
        return "an unknown process"
    return f"pid {pid or '?'} on host {host or '?'}"


def _take_lock(path: str, rank: int, config_key: str) -> int:
    """Hold an exclusive flock on `<path>.lock` (fd returned), replacing the files of a run that is gone.

    flock is released by the kernel when its holder dies, so a lock file we can lock is a crashed run's.
    """
    lock_path = path + ".lock"
    for _ in range(10):  # the owner may unlink the lock file between our open and our flock: retry
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"rank {rank}: {path} is in use by another run ({_lock_owner(lock_path)} holds {lock_path}); "
                f"choose another {config_key} for this run"
            ) from None
        except OSError as e:
            os.close(fd)
            raise ValueError(f"{config_key}: cannot flock {lock_path} ({e}); use a local filesystem") from e
        try:
            locked_current = os.path.samestat(os.fstat(fd), os.stat(lock_path))
        except FileNotFoundError:
            locked_current = False
        if not locked_current:
            os.close(fd)
            continue
        if os.path.exists(path):
            owner = _lock_owner(lock_path)
            logger.warning("rank %d: replacing %s, left by a run that is gone (%s)", rank, path, owner)
            os.unlink(path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        return fd
    raise RuntimeError(f"rank {rank}: could not lock {lock_path}: it kept being replaced")


# --- the store ----------------------------------------------------------------------------------------------


class NvmeStore:
    """One rank's swap file of named flat tensors with asynchronous reads and writes.

    Invariants: regions never overlap or move; the file is preallocated to at least the end of the last
    region; each region is padded to whole pages (so a tail page may be transferred whole); this process
    holds an exclusive flock on `<path>.lock` from the constructor until `close`.

    Caller's contract: a tensor given to `write`/`read` stays alive and untouched (for `write`: unmodified;
    for `read`: unread) until its future is done, and a read and a write of the same key are never in flight
    at once. Any number of reads and writes of different keys may be in flight; futures complete in any
    order. The methods may be called from several threads.
    """

    def __init__(
        self,
        directory: str,
        *,
        rank: int,
        purpose: str,
        capacity_bytes: int,
        aio: AioSettings = AioSettings(),
        config_key: str = "zero_optimization.offload_optimizer.nvme_path",
    ) -> None:
        """Create (or safely replace) `<directory>/zeroshard-<purpose>-rank<rank>.swp`, preallocated.

        Raises:
            ValueError: starting with `config_key`: the directory is missing, not a directory or not
                writable, or has less free space than `capacity_bytes`. Starting with the argument's name:
                `purpose`, `rank` or `capacity_bytes` is invalid.
            RuntimeError: another live process holds this file's lock.
        """
        if not _PURPOSE.match(purpose):
            raise ValueError(f"purpose={purpose!r}: expected letters, digits, '_', '.' or '-'")
        if rank < 0 or capacity_bytes < 0:
            raise ValueError(f"rank={rank}, capacity_bytes={capacity_bytes}: expected both >= 0")
        directory = os.path.abspath(directory)
        _check_directory(directory, config_key)
        self.rank, self.aio, self.config_key, self.directory = rank, aio, config_key, directory
        path = os.path.join(directory, f"zeroshard-{purpose}-rank{rank}.swp")
        self._io = _Engine(path, _take_lock(path, rank, config_key), rank, aio)
        self._finalizer = weakref.finalize(self, self._io.cleanup)  # also runs at interpreter exit
        self.stats: IoStats = self._io.stats
        self.capacity = 0
        """Bytes preallocated in the file."""
        self._regions: dict[str, _Region] = {}
        self._end = 0
        self._lock = threading.Lock()  # regions, _end, capacity
        try:
            _check_space(directory, _round_up(capacity_bytes), config_key, "for this rank's offload file")
            self._io.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            self._preallocate(_round_up(capacity_bytes))
            try:
                self._io.direct_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
            except OSError as e:  # tmpfs and some network filesystems
                logger.info("rank %d: %s refuses O_DIRECT (%s); using buffered I/O", rank, path, e)
            self._io.pool = ThreadPoolExecutor(aio.intra_op_parallelism, f"nvme-{purpose}-rank{rank}")
        except BaseException:
            self._finalizer()
            raise

    def _preallocate(self, capacity: int) -> None:
        try:
            if capacity > self.capacity:
                os.posix_fallocate(self._io.fd, 0, capacity)
        except OSError as e:
            raise ValueError(
                f"{self.config_key}={self.directory!r}: could not preallocate {_gb(capacity)} for "
                f"{self.path}: {e}"
            ) from e
        self.capacity = capacity

    @staticmethod
    def bytes_needed(sizes: Iterable[int]) -> int:
        """File size for regions of these byte sizes: each is padded to a multiple of `ALIGN`."""
        return sum(_round_up(n) for n in sizes)

    @property
    def path(self) -> str:
        """The swap file."""
        return self._io.path

    @property
    def direct_io(self) -> bool:
        """Whether aligned buffers go through O_DIRECT (False on a filesystem that refuses it)."""
        return self._io.direct_fd is not None and self._io.use_direct

    def has(self, key: str) -> bool:
        """Whether `key` has a region (reserved or written)."""
        with self._lock:
            return key in self._regions

    def reserve(self, key: str, nbytes: int) -> None:
        """Give `key` a page-aligned region of `nbytes`, growing the file when capacity runs out.

        Raises:
            RuntimeError: `key` already has a region of a different size.
            ValueError: starting with `config_key`: growing needs more than the disk's free space.
        """
        self._region(key, nbytes)

    def _region(self, key: str, nbytes: int) -> _Region:
        with self._lock:
            region = self._regions.get(key)
            if region is not None:
                if region.nbytes != nbytes:
                    raise RuntimeError(
                        f"rank {self.rank}: key {key!r} has a region of {region.nbytes} bytes in "
                        f"{self.path}, not {nbytes}"
                    )
                return region
            end = self._end + _round_up(nbytes)
            if end > self.capacity:
                # Grow by at least a quarter to amortize, but by just enough when the disk is short.
                want = max(end, _round_up(self.capacity + self.capacity // 4))
                if _free_bytes(self.directory) < want - self.capacity:
                    want = end
                _check_space(
                    self.directory, want - self.capacity, self.config_key, "to grow the offload file"
                )
                self._preallocate(want)
            region = self._regions[key] = _Region(self._end, nbytes)
            self._end = end
            return region

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor whose data pointer is `ALIGN`-aligned, so that its I/O is direct."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(_round_up(nbytes) + ALIGN, dtype=torch.uint8)
        skip = -raw.data_ptr() % ALIGN
        return raw[skip : skip + nbytes].view(dtype)

    def write(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Write `tensor`'s bytes to `key`'s region (reserved on first use); see the caller's contract.

        Raises:
            ValueError: `tensor` is not a contiguous CPU tensor.
            RuntimeError: `key` has a region of another size; the store is closed.
        """
        _check_tensor("tensor", tensor)
        region = self._region(key, tensor.nbytes)
        region.written, region.failed = True, False
        return self._io.submit("write", key, region, tensor)

    def read(self, key: str, out: torch.Tensor) -> Future[None]:
        """Fill `out` with the bytes last written to `key`; see the caller's contract.

        Raises:
            KeyError: `key` was never written.
            ValueError: `out` is not a contiguous CPU tensor of the written byte size.
            RuntimeError: the last write of `key` failed; the store is closed.
        """
        _check_tensor("out", out)
        with self._lock:
            region = self._regions.get(key)
        if region is None or not region.written:
            raise KeyError(f"rank {self.rank}: key {key!r} was never written to {self.path}")
        if region.failed:
            raise RuntimeError(f"rank {self.rank}: the last write of key {key!r} to {self.path} failed")
        if out.nbytes != region.nbytes:
            raise ValueError(f"out has {out.nbytes} bytes; key {key!r} holds {region.nbytes}")
        return self._io.submit("read", key, region, out)

    def synchronize(self, timeout_s: float = 1800.0) -> None:
        """Wait for every outstanding request; re-raise the first error since the last call.

        Raises:
            RuntimeError: naming rank, key and file, from the first failed request; or after `timeout_s`.
        """
        self._io.wait(timeout_s)

    def close(self) -> None:
        """Wait for outstanding requests, then close and delete the file and its lock; idempotent.

        Raises:
            RuntimeError: as `synchronize`; the files are removed all the same.
        """
        if not self._finalizer.alive:
            return
        try:
            self.synchronize()
        finally:
            self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous CPU tensor, got device={tensor.device}, "
            f"contiguous={tensor.is_contiguous()}"
        )
