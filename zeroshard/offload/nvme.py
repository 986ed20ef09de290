"""The NVMe swap store: one rank's named flat tensors in one preallocated file (ZeRO-Infinity's tier).

Vocabulary: a *key* names one flat tensor; its *region* is a page-aligned byte range of the file, fixed at
first `reserve`/`write`. How requests become system calls is `zeroshard.offload.aio`'s job (see its
[Note: direct I/O] and [Note: queue depth]); the file's checks, lock, growth and removal are
`zeroshard.offload.swapfile`'s. This module maps keys to regions and composes the two.
"""

from __future__ import annotations

import os
import re
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from zeroshard.offload.aio import ALIGN, AioEngine, AioSettings, IoStats, Region, round_up
from zeroshard.offload.swapfile import SwapFile

__all__ = ["ALIGN", "AioSettings", "IoStats", "NvmeStore"]

_PURPOSE = re.compile(r"^[A-Za-z0-9_.-]+$")
_DEFAULT_AIO = AioSettings()


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
        aio: AioSettings = _DEFAULT_AIO,
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
        name = f"zeroshard-{purpose}-rank{rank}.swp"
        self._file = SwapFile(directory, name, rank=rank, config_key=config_key)
        self.rank, self.aio, self.config_key, self.directory = rank, aio, config_key, directory
        try:
            self._file.create(round_up(capacity_bytes))
            self._io = AioEngine(
                self._file.path,
                self._file.fd,
                self._file.direct_fd,
                rank=rank,
                aio=aio,
                thread_name=f"nvme-{purpose}-rank{rank}",
            )
        except BaseException:
            self._file.cleanup()
            raise
        # Holds the file and the engine, not the store; also runs at interpreter exit.
        self._finalizer = weakref.finalize(self, self._file.cleanup, self._io.shutdown)
        self.stats: IoStats = self._io.stats
        self._regions: dict[str, Region] = {}
        self._end = 0
        self._lock = threading.Lock()  # regions, _end, the file's growth

    @staticmethod
    def bytes_needed(sizes: Iterable[int]) -> int:
        """File size for regions of these byte sizes: each is padded to a multiple of `ALIGN`."""
        return sum(round_up(n) for n in sizes)

    @property
    def path(self) -> str:
        """The swap file."""
        return self._file.path

    @property
    def capacity(self) -> int:
        """Bytes preallocated in the file."""
        return self._file.capacity

    @property
    def direct_io(self) -> bool:
        """Whether aligned buffers go through O_DIRECT (False on a filesystem that refuses it)."""
        return self._io.direct_io

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

    def _region(self, key: str, nbytes: int) -> Region:
        with self._lock:
            region = self._regions.get(key)
            if region is not None:
                if region.nbytes != nbytes:
                    raise RuntimeError(
                        f"rank {self.rank}: key {key!r} has a region of {region.nbytes} bytes in "
                        f"{self.path}, not {nbytes}"
                    )
                return region
            end = self._end + round_up(nbytes)
            self._file.grow(end)
            region = self._regions[key] = Region(self._end, nbytes)
            self._end = end
            return region

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor whose data pointer is `ALIGN`-aligned, so that its I/O is direct."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = torch.empty(round_up(nbytes) + ALIGN, dtype=torch.uint8)
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

    def write_ranges(self, flat: torch.Tensor, ranges: Iterable[tuple[str, int, int]]) -> None:
        """Write ``flat[start:start + numel]`` to each ``key`` of ``ranges`` (key, start, numel), all in
        flight at once, and wait for them (moving a tensor into the store)."""
        cpu = flat.to("cpu")
        parts = [cpu[start : start + numel].contiguous() for _, start, numel in ranges]
        futures = [self.write(key, part) for (key, _, _), part in zip(ranges, parts, strict=True)]
        for future in futures:
            future.result()

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
