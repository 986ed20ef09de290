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

* A buffer is reused only when nothing else refers to its storage (its use count, checked when it is given
  back): a view held elsewhere (a user's reference to ``param.data``, a tensor autograd saved) keeps its
  memory and the buffer is simply dropped to the allocator.
* The pool's footprint, idle plus handed out, stays within the high-water mark (the most bytes ever handed
  out at one time) plus ``spare_bytes``: idle buffers fill the room that the step's own peak of live
  buffers leaves, plus a little (the engine sets one of its largest units), never more. The oldest idle
  buffers are freed first when room is needed. So the pool adds at most ``spare_bytes`` to the process's
  peak, and a training step, which repeats the same requests every step, finds every buffer idle after
  the first steps: no page faults, no unmapping, across steps too (nothing is trimmed between steps; the
  idle bytes are reported by ``engine.memory_breakdown().cached_buffers``).
* Requests made under :meth:`BufferPool.exempt` (the whole model gathered for generation or export) do not
  raise the high-water mark, so a one-off demand never makes the pool keep that much idle afterwards.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import torch

# How much larger than the request an idle buffer may be and still serve it (a fraction of the request).
SLACK = 0.25


def _storage_users(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


# What the count reads for a tensor that is its storage's only user (the temporary Python storage object
# taken to read it may count too, depending on the torch version).
_SOLE_USER = _storage_users(torch.empty(1))


def owns_whole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous, spans its whole storage and is that storage's only user: it can then
    serve as a buffer of its own without a copy (nothing else sees its writes)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and _storage_users(tensor) == _SOLE_USER
    )


def _first(buffer: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``buffer``'s storage as a tensor of its own (not an autograd view,
    which would keep ``buffer`` alive and so look like a second user of the storage)."""
    return buffer.new_empty(0).set_(buffer.untyped_storage(), 0, (numel,), (1,))


class BufferPool:
    """Flat 1-D CPU buffers for reuse: see [Note: buffer reuse]. Not thread-safe."""

    def __init__(self, spare_bytes: int = 0) -> None:
        self.spare_bytes = spare_bytes
        self._idle: OrderedDict[int, torch.Tensor] = OrderedDict()  # whole buffers, oldest first
        self._serial = 0
        self._exempt = 0
        self.idle_bytes = 0
        self.out_bytes = 0  # handed out and not given back (whole buffers)
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0

    def room(self) -> int:
        """How many idle bytes the pool may keep now (see the invariants in [Note: buffer reuse])."""
        return max(0, self.high_water_bytes - self.out_bytes) + self.spare_bytes

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements with arbitrary contents (reused, or newly allocated)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        best: tuple[int, torch.Tensor] | None = None
        for serial, buf in self._idle.items():
            if buf.dtype == dtype and numel <= buf.numel() <= numel * (1 + SLACK):
                if best is None or buf.numel() < best[1].numel():
                    best = (serial, buf)
        if best is not None:
            serial, buf = best
            del self._idle[serial]
            nbytes = buf.numel() * buf.element_size()
            self.idle_bytes -= nbytes
            self._hand_out(nbytes)
            self.hits += 1
            return buf if buf.numel() == numel else _first(buf, numel)
        self.misses += 1
        self._hand_out(numel * dtype.itemsize)
        self._trim(self.room())  # the new buffer takes room from idle ones
        return torch.empty(numel, dtype=dtype, device=device)

    def _hand_out(self, nbytes: int) -> None:
        self.out_bytes += nbytes
        if not self._exempt:
            self.high_water_bytes = max(self.high_water_bytes, self.out_bytes)

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back a tensor from :meth:`take`; its buffer is kept for reuse if nothing else refers to it."""
        if buffer.device.type != "cpu":
            return
        sole_user = _storage_users(buffer) == _SOLE_USER  # before this function holds the storage too
        nbytes = buffer.untyped_storage().nbytes()
        self.out_bytes = max(0, self.out_bytes - nbytes)
        if not sole_user or buffer.storage_offset() != 0:
            return  # still in use elsewhere: the allocator frees it when the last user lets go
        if nbytes > self.room():
            return  # no room for it now, or not one of ours (more than the pool ever handed out at once)
        whole = buffer
        if buffer.numel() * buffer.element_size() != nbytes:
            whole = _first(buffer, nbytes // buffer.element_size())
        self._serial += 1
        self._idle[self._serial] = whole
        self.idle_bytes += nbytes
        self._trim(self.room())

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
        """Free every idle buffer."""
        self._trim(0)

    def _trim(self, limit: int) -> None:
        while self._idle and self.idle_bytes > limit:
            _, old = self._idle.popitem(last=False)
            self.idle_bytes -= old.numel() * old.element_size()
