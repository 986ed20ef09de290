"""The swap file's life cycle: start-up checks, the lock, creation, preallocation, growth and removal.

A run holds an exclusive flock on `<path>.lock` for as long as `<path>` exists. flock is released by the
kernel when its holder dies, so a lock file that can be locked was left by a run that is gone, and its
swap file is replaced.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
from collections.abc import Callable

from zeroshard.offload.aio import round_up

__all__ = ["SwapFile"]

logger = logging.getLogger(__name__)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB ({n} bytes)"


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


def _check_space(directory: str, needed: int, config_key: str, what: str, free: int | None = None) -> None:
    """Raise a ValueError starting with `config_key` when `directory` has less than `needed` bytes free.

    `free` is the free space already measured; by default it is measured now.
    """
    free = _free_bytes(directory) if free is None else free
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
    """Hold an exclusive flock on `<path>.lock` (fd returned), replacing the files of a run that is gone."""
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


def _close_all(*fds: int | None) -> None:
    for fd in fds:
        if fd is not None and fd >= 0:
            os.close(fd)


class SwapFile:
    """One rank's swap file, its descriptors and its lock.

    Invariants: from the constructor until `cleanup`, this process holds an exclusive flock on `<path>.lock`;
    after `create`, the file is preallocated to `capacity` bytes, a multiple of `ALIGN`. Not thread-safe:
    the store serializes `grow`.
    """

    def __init__(self, directory: str, name: str, *, rank: int, config_key: str) -> None:
        """Check `directory` and lock `<directory>/<name>`, replacing the files of a run that is gone.

        Raises:
            ValueError: starting with `config_key`: the directory is missing, not a directory or not
                writable, or cannot be flocked.
            RuntimeError: another live process holds this file's lock.
        """
        _check_directory(directory, config_key)
        self.directory, self.config_key, self.rank = directory, config_key, rank
        self.path = os.path.join(directory, name)
        self.lock_path = self.path + ".lock"
        self.lock_fd = _take_lock(self.path, rank, config_key)
        self.owner_pid = os.getpid()  # a forked child that exits must not delete its parent's files
        self.fd = -1
        self.direct_fd: int | None = None
        """The O_DIRECT descriptor; None where the filesystem refuses it (see [Note: direct I/O] in aio)."""
        self.capacity = 0
        """Bytes preallocated in the file."""

    def create(self, capacity: int) -> None:
        """Create the file preallocated to `capacity` (a multiple of `ALIGN`) and open its descriptors.

        Raises:
            ValueError: starting with `config_key`: the disk has less free space than `capacity`.
        """
        _check_space(self.directory, capacity, self.config_key, "for this rank's offload file")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._preallocate(capacity)
        try:
            self.direct_fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
        except OSError as e:  # tmpfs and some network filesystems
            logger.info("rank %d: %s refuses O_DIRECT (%s); using buffered I/O", self.rank, self.path, e)

    def grow(self, end: int) -> None:
        """Preallocate at least `end` bytes (a multiple of `ALIGN`); a no-op when `capacity` suffices.

        Raises:
            ValueError: starting with `config_key`: growing needs more than the disk's free space.
        """
        if end <= self.capacity:
            return
        # Grow by at least a quarter to amortize, but by just enough when the disk is short.
        want = max(end, round_up(self.capacity + self.capacity // 4))
        free = _free_bytes(self.directory)
        if free < want - self.capacity:
            want = end
        _check_space(self.directory, want - self.capacity, self.config_key, "to grow the offload file", free)
        self._preallocate(want)

    def _preallocate(self, capacity: int) -> None:
        try:
            if capacity > self.capacity:
                os.posix_fallocate(self.fd, 0, capacity)
        except OSError as e:
            raise ValueError(
                f"{self.config_key}={self.directory!r}: could not preallocate {_gb(capacity)} for "
                f"{self.path}: {e}"
            ) from e
        self.capacity = capacity

    def cleanup(self, drain: Callable[[], None] | None = None) -> None:
        """Call `drain`, close the descriptors, delete the file, then the lock file, then drop the lock.

        `drain` stops all use of the descriptors (the I/O engine's `shutdown`). In a forked child only the
        inherited descriptors are closed: the files are the parent's. Call once.
        """
        if os.getpid() != self.owner_pid:
            _close_all(self.direct_fd, self.fd, self.lock_fd)
            return
        if drain is not None:
            drain()
        _close_all(self.direct_fd, self.fd)
        self.direct_fd, self.fd = None, -1
        for p in (self.path, self.lock_path):  # the lock file last, while we still hold its flock
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        os.close(self.lock_fd)
