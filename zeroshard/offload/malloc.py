"""Keeping the C allocator from holding on to memory that offload moved out (glibc only; no-ops elsewhere).

Offload moves many transient blocks of a few MB through the allocator (sub-group buffers, gathered
stage-3 units, the full copy of each submodule ``zero.Init`` builds), from several threads. glibc serves
such blocks from its heaps once a block of 32 MB or more has been freed, and keeps what is freed there: the
resident size then drifts up towards the very state the offload keeps out of memory. Two remedies, both
process-wide C-library settings, not zeroshard state:

* :func:`keep_large_blocks_mapped`: blocks of ``MMAP_THRESHOLD`` bytes and more get their own mapping,
  returned to the system when freed (set once when an engine offloads to NVMe);
* :func:`release_free_memory`: hand back what the heaps hold unused (after each offloaded step, after a
  unit's state moved to NVMe, at the end of ``zero.Init``).
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a block gets its own mapping under :func:`keep_large_blocks_mapped`."""


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018  (glibc has both; musl and macOS do not)
        libc.mallopt  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


_GLIBC = _glibc()


def keep_large_blocks_mapped() -> None:
    """Serve blocks of ``MMAP_THRESHOLD`` bytes and more from their own mappings (process-wide)."""
    if _GLIBC is not None:
        _GLIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def release_free_memory() -> None:
    """Give memory the C allocator holds but nothing uses back to the system (glibc's malloc_trim)."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)
