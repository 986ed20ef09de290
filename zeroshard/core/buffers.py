"""Reuse of the transient flat buffers: stage-3 gathered parameters, gradient buckets, reduce-scatter outputs.

[Note: buffer reuse]
Stage 3 allocates every unit's full parameters twice per step (forward and backward) and, like stage 2, a
gradient bucket per unit per backward. On the CPU a large allocation is a fresh ``mmap`` whose pages fault
in, zeroed by the kernel, on first write, and freeing it unmaps them again: on a two-core machine that
costs as much as the exchange that fills the buffer. A :class:`BufferPool` keeps a given-back buffer and
hands it out again, as the CUDA caching allocator does for GPU tensors (on a GPU the pool steps aside and
lets that allocator do it). A request is served by the smallest idle buffer of its dtype that holds it
with at most ``SLACK`` to spare (a transformer block's linears differ by a bias or two), as a view of its
first elements.

Invariants:

* A buffer is reused only when nothing else refers to its memory. The pool hands out an alias of each
  buffer it owns (``torch.from_dlpack``: a storage of its own over the same memory) and keeps a weak
  reference to that alias's storage, which lives exactly as long as some tensor uses it (a view, the
  caller's own reference, a tensor autograd saved, a user's ``param.data``). A given-back buffer becomes
  idle once that storage is gone, so a buffer still held elsewhere is never handed out again and is reused
  as soon as its last user lets go. Buffers the pool did not hand out are never kept.
* The pool's footprint, given back plus handed out, stays within the high-water mark (the most bytes ever
  handed out at one time) plus ``spare_bytes``: idle buffers fill the room that the step's own peak of live
  buffers leaves, plus a little (the engine sets two bucket-sized units, ``build.py``), never more. The
  oldest idle buffers are freed first when room is needed. So the pool adds at most ``spare_bytes`` to the
  process's peak, and a training step, which repeats the same requests every step, finds most buffers idle
  after the first steps: few page faults, little unmapping, across steps too (the idle bytes are reported
  by ``engine.memory_breakdown().cached_buffers``). New buffers are rounded up by at most 1/64
  (``_rounded``), so requests a bias apart share them.
* The caller may let go of idle buffers early with :meth:`BufferPool.shrink` (the gatherer does it before
  the last units of a stage-3 backward: [Note: trim before the backward's end] in ``stage3/gatherer.py``);
  later requests then allocate again, up to the same bounds. Nothing else trims between steps.
* Requests made under :meth:`BufferPool.exempt` (the whole model gathered for generation or export) do not
  raise the high-water mark, so a one-off demand never makes the pool keep that much idle afterwards.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.dlpack import from_dlpack

# How much larger than the request an idle buffer may be and still serve it (a fraction of the request).
SLACK = 0.25
# New buffers are allocated in steps of 2**-GRAIN_BITS of their size's largest power of two: see _rounded.
GRAIN_BITS = 6


def _rounded(numel: int) -> int:
    """``numel`` rounded up to a multiple of 1/64 of its largest power of two (at most 1.6 % more), so that
    requests a bias apart (a linear's gathered parameters and another's gradient bucket) share buffers."""
    step = 1 << max(0, numel.bit_length() - 1 - GRAIN_BITS)
    return -(-numel // step) * step


@dataclass
class _Returned:
    """A given-back buffer the pool owns, and the storage of the alias it was lent as."""

    whole: torch.Tensor
    alias: weakref.ref[torch.UntypedStorage]

    @property
    def nbytes(self) -> int:
        return self.whole.numel() * self.whole.element_size()

    def in_use(self) -> bool:
        return self.alias() is not None


@dataclass
class _Lent:
    """A buffer handed out. Both references are weak: a buffer never given back is freed with its alias."""

    memory: weakref.ref[torch.UntypedStorage]  # the pool's buffer (kept alive by the alias while it lives)
    dtype: torch.dtype
    numel: int  # the whole buffer's
    alias: weakref.ref[torch.UntypedStorage]


def _lend(whole: torch.Tensor, numel: int) -> tuple[torch.Tensor, _Lent]:
    """An alias of ``whole``'s first ``numel`` elements with a storage of its own, and its record."""
    alias = from_dlpack(whole[:numel])
    memory = weakref.ref(whole.untyped_storage())
    return alias, _Lent(memory, whole.dtype, whole.numel(), weakref.ref(alias.untyped_storage()))


class BufferPool:
    """Flat 1-D CPU buffers for reuse: see [Note: buffer reuse]. Not thread-safe."""

    def __init__(self, spare_bytes: int = 0) -> None:
        self.spare_bytes = spare_bytes
        self._lent: dict[int, _Lent] = {}  # handed out, by the address of their memory
        self._returned: OrderedDict[int, _Returned] = OrderedDict()  # given back, oldest first
        self._returned_bytes = 0  # given back and still owned by the pool, idle or not yet
        self._serial = 0
        self._exempt = 0
        self.out_bytes = 0  # handed out and not given back (whole buffers)
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0
        self.shrunk = 0  # given-back buffers let go of by shrink()

    @property
    def idle_bytes(self) -> int:
        """Bytes of given-back buffers that nothing refers to any more: ready to be handed out again."""
        return sum(lease.nbytes for lease in self._returned.values() if not lease.in_use())

    def room(self) -> int:
        """How many given-back bytes the pool may keep now (see the invariants in [Note: buffer reuse])."""
        return max(0, self.high_water_bytes - self.out_bytes) + self.spare_bytes

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements with arbitrary contents (reused, or newly allocated)."""
        if device.type != "cpu" or numel == 0:
            return torch.empty(numel, dtype=dtype, device=device)
        best: tuple[int, _Returned] | None = None
        for serial, lease in self._returned.items():
            buf = lease.whole
            if buf.dtype == dtype and numel <= buf.numel() <= numel * (1 + SLACK) and not lease.in_use():
                if best is None or buf.numel() < best[1].whole.numel():
                    best = (serial, lease)
        if best is not None:
            serial, lease = best
            del self._returned[serial]
            self._returned_bytes -= lease.nbytes
            self.hits += 1
            whole = lease.whole
        else:
            self.misses += 1
            whole = torch.empty(_rounded(numel), dtype=dtype, device=device)
        alias, lent = _lend(whole, numel)
        self._forget_dead_loans()
        self._lent[whole.data_ptr()] = lent
        self._hand_out(whole.numel() * whole.element_size())
        if best is None:
            self._trim(self.room())  # the new buffer takes room from given-back ones
        return alias

    def _hand_out(self, nbytes: int) -> None:
        self.out_bytes += nbytes
        if not self._exempt:
            self.high_water_bytes = max(self.high_water_bytes, self.out_bytes)

    def give(self, buffer: torch.Tensor, keep: bool = True) -> None:
        """Hand back a tensor from :meth:`take`; its buffer is reused once nothing refers to it any more, or
        with ``keep=False`` freed by the allocator once nothing does."""
        if buffer.device.type != "cpu" or buffer.storage_offset() != 0:
            return
        lent = self._lent.get(buffer.data_ptr())
        memory = lent.memory() if lent is not None else None
        if lent is None or memory is None or lent.alias() is not buffer.untyped_storage():
            return  # not one of ours (the engine's initial parameters): the allocator frees it
        del self._lent[buffer.data_ptr()]
        whole = torch.empty(0, dtype=lent.dtype).set_(memory, 0, (lent.numel,), (1,))
        returned = _Returned(whole, lent.alias)
        self.out_bytes = max(0, self.out_bytes - returned.nbytes)
        if not keep or returned.nbytes > self.room():
            return  # not kept, or no room for it now: the allocator frees it when its last user lets go
        self._serial += 1
        self._returned[self._serial] = returned
        self._returned_bytes += returned.nbytes
        self._trim(self.room())

    def _forget_dead_loans(self) -> None:
        """Drop the records of buffers handed out and freed without being given back."""
        dead = [address for address, lent in self._lent.items() if lent.memory() is None]
        for address in dead:
            del self._lent[address]

    @contextlib.contextmanager
    def exempt(self) -> Iterator[None]:
        """Requests inside the block do not raise the high-water mark (a one-off demand, e.g. the whole model
        gathered for generation): afterwards the pool keeps no more than the training steps need."""
        self._exempt += 1
        try:
            yield
        finally:
            self._exempt -= 1

    def clear(self) -> None:
        """Let go of every given-back buffer."""
        self._trim(0)

    def shrink(self, keep_bytes: int) -> None:
        """Let go of given-back buffers, oldest first, until they hold at most ``keep_bytes``: before a
        stretch of the step that requests less than the pool holds idle (see [Note: trim before the
        backward's end])."""
        kept = len(self._returned)
        self._trim(max(0, keep_bytes))
        self.shrunk += kept - len(self._returned)

    def _trim(self, limit: int) -> None:
        while self._returned and self._returned_bytes > limit:
            _, old = self._returned.popitem(last=False)
            self._returned_bytes -= old.nbytes
