"""Writing a checkpoint file: through a small aligned buffer, hashed there, with direct I/O where it works.

[Note: direct checkpoint writes]
A checkpoint file is written in the ``BOUNCE`` bytes of one page-aligned buffer at a time: the bytes are
copied in, hashed (SHA-256) while they are in the cache, and written with ``O_DIRECT`` where the file
system takes it, so the kernel neither copies them into its page cache nor has its writeback threads flush
them later. Each byte of the source is read once. Measured on the large GPT's 1 GB shard per rank (W=2,
2 cores; bench/checkpoint_async.py, docs/checkpoints.md): a synchronous save takes half the time of a
buffered write followed by a separate hash, and training steps during an asynchronous save's background
write slow by a few percent instead of a fifth. The buffered page-cache write was the cost: hashing alone
barely slowed the steps.

Direct I/O needs aligned memory, offsets and sizes: the buffer is an anonymous ``mmap`` (page-aligned),
every write but the last is a whole buffer, and the last is padded to 4096 bytes and the file truncated to
its true size before the ``fsync``. Where ``O_DIRECT`` does not exist (not Linux), the open refuses it
(tmpfs), or a write refuses it, the file is written buffered through the same buffer, with the same bytes
and checksum. Readers open the file normally; Linux keeps the page cache coherent with direct writes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import mmap
import os
from types import TracebackType

__all__ = ["BOUNCE", "FileSink"]

BOUNCE = 2 * 1024 * 1024  # bytes per write: small enough that the hash reads them from the cache
_ALIGN = 4096  # the largest logical block size direct I/O asks offsets and sizes to be a multiple of
_DIRECT = getattr(os, "O_DIRECT", 0)


class FileSink:
    """A new file at ``path``, written through :meth:`write` and made durable by :meth:`close`, which returns
    its size and SHA-256 ([Note: direct checkpoint writes]). Use as a context manager; on an error the file
    is left as written so far (the caller removes the temporary directory)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.nbytes = 0
        self._digest = hashlib.sha256()
        self._buffer = mmap.mmap(-1, BOUNCE)
        self._view = memoryview(self._buffer)
        self._fill = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags | _DIRECT, 0o644)  # _DIRECT is 0 where O_DIRECT does not exist
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)  # a file system without direct I/O

    def __enter__(self) -> FileSink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._view.release()
        self._buffer.close()

    def write(self, data: bytes | memoryview) -> None:
        """Append ``data`` to the file (through the buffer)."""
        source = memoryview(data).cast("B")
        at = 0
        while at < len(source):
            n = min(BOUNCE - self._fill, len(source) - at)
            self._view[self._fill : self._fill + n] = source[at : at + n]
            self._fill += n
            at += n
            if self._fill == BOUNCE:
                self._flush(BOUNCE)
        self.nbytes += len(source)

    def close(self) -> tuple[int, str]:
        """Write what the buffer holds, make the file durable and close it; its size and SHA-256."""
        if self._fill:
            self._flush(-(-self._fill // _ALIGN) * _ALIGN)
        os.ftruncate(self._fd, self.nbytes)  # the padding of the last write goes
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        return self.nbytes, self._digest.hexdigest()

    def _flush(self, size: int) -> None:
        """Hash the buffer's bytes and write ``size`` bytes of it (the tail beyond them zeroed padding)."""
        self._digest.update(self._view[: self._fill])
        self._view[self._fill : size] = bytes(size - self._fill)
        with self._view[:size] as chunk:  # released even when a write raises (the buffer can then close)
            try:
                written = os.write(self._fd, chunk)
            except OSError as err:
                if err.errno != errno.EINVAL or not _DIRECT:
                    raise
                # Direct I/O opened but refused here: go on buffered, from the same offset.
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_DIRECT)
                written = os.write(self._fd, chunk)
        if written != size:  # a regular file writes short only when its disk is full
            raise OSError(errno.ENOSPC, f"wrote {written} of {size} bytes (is the disk full?)", self.path)
        self._fill = 0
