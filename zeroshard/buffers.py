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
* At most ``idle_limit`` bytes are kept idle, and never more than the most bytes handed out at one time
  (``high_water_bytes``); the oldest idle buffers are freed first. The engine sets the limit to two of its
  largest units: enough for the next gather or bucket to find the buffer a unit just released, while the
  memory the pool adds to a peak is at most those two units.
* At the end of every optimizer step (``GradientReducer.zero_grad``) the pool keeps only the most recently
  given back ``keep_between_steps`` bytes: at stage 3 the prefetch window (within the idle limit), which the
  next forward's first gathers take at once (the last units released in backward are the first ones the
  forward needs), and nothing at stages 0-2.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# How much larger than the request an idle buffer may be and still serve it (a fraction of the request).
SLACK = 0.25


def _storage_users(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


# What the count reads for a tensor that is its storage's only user (the temporary Python storage object
# taken to read it may count too, depending on the torch version).
_SOLE_USER = _storage_users(torch.empty(1))


def _first(buffer: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``buffer``'s storage as a tensor of its own (not an autograd view,
    which would keep ``buffer`` alive and so look like a second user of the storage)."""
    return buffer.new_empty(0).set_(buffer.untyped_storage(), 0, (numel,), (1,))


class BufferPool:
    """Flat 1-D CPU buffers for reuse: see [Note: buffer reuse]. Not thread-safe."""

    def __init__(self, idle_limit: int = 0, keep_between_steps: int = 0) -> None:
        self.idle_limit = idle_limit
        self.keep_between_steps = keep_between_steps
        self._idle: OrderedDict[int, torch.Tensor] = OrderedDict()  # whole buffers, oldest first
        self._serial = 0
        self.idle_bytes = 0
        self.out_bytes = 0  # handed out and not given back (whole buffers)
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0

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
            self.out_bytes += nbytes
            self.hits += 1
            return buf if buf.numel() == numel else _first(buf, numel)
        self.misses += 1
        self.out_bytes += numel * dtype.itemsize
        self.high_water_bytes = max(self.high_water_bytes, self.out_bytes)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back a tensor from :meth:`take`; its buffer is kept for reuse if nothing else refers to it."""
        if buffer.device.type != "cpu":
            return
        sole_user = _storage_users(buffer) == _SOLE_USER  # before this function holds the storage too
        nbytes = buffer.untyped_storage().nbytes()
        self.out_bytes = max(0, self.out_bytes - nbytes)
        if not sole_user or buffer.storage_offset() != 0:
            return  # still in use elsewhere: the allocator frees it when the last user lets go
        if nbytes > min(self.idle_limit, self.high_water_bytes):
            return  # larger than the pool keeps, or not one of ours (more than it ever handed out at once)
        whole = buffer
        if buffer.numel() * buffer.element_size() != nbytes:
            whole = _first(buffer, nbytes // buffer.element_size())
        self._serial += 1
        self._idle[self._serial] = whole
        self.idle_bytes += nbytes
        self._trim(min(self.idle_limit, self.high_water_bytes))

    def end_step(self) -> None:
        """Free idle buffers, oldest first, down to ``keep_between_steps`` bytes."""
        self._trim(min(self.keep_between_steps, self.idle_limit))

    def clear(self) -> None:
        """Free every idle buffer."""
        self._trim(0)

    def _trim(self, limit: int) -> None:
        while self._idle and self.idle_bytes > limit:
            _, old = self._idle.popitem(last=False)
            self.idle_bytes -= old.numel() * old.element_size()
