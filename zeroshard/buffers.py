"""Reuse of the transient flat buffers: stage-3 gathered parameters, gradient buckets, reduce-scatter outputs.

[Note: buffer reuse]
Stage 3 allocates every unit's full parameters twice per step (forward and backward) and, like stage 2, a
gradient bucket per unit per backward. On the CPU a large allocation is a fresh ``mmap`` whose pages fault
in, zeroed by the kernel, on first write, and freeing it unmaps them again: on a two-core machine that
costs as much as the all-gather that fills the buffer. A :class:`BufferPool` keeps a given-back buffer and
hands it out again for the next request of the same size, dtype and device, as the CUDA caching allocator
does for GPU tensors (on a GPU the pool steps aside and lets that allocator do it).

Invariants:

* A buffer is reused only when nothing else refers to its storage (its use count, checked when it is given
  back): a view held elsewhere (a user's reference to ``param.data``, a tensor autograd saved) keeps its
  memory and the buffer is simply dropped to the allocator.
* The idle bytes never exceed the most bytes handed out at one time (``high_water_bytes``): the oldest
  idle buffer is freed first when they would. Units of a few sizes (a transformer block's linears) then
  find their size idle almost always, at the cost of at most that much memory kept between uses.
* At the end of every optimizer step (``GradientReducer.zero_grad``) the pool keeps only the most recently
  given back ``keep_between_steps`` bytes: at stage 3 the prefetch window, which the next forward's first
  gathers take at once (the last units released in backward are the first ones the forward needs), and
  nothing at stages 0-2. So no idle buffer sits beside the next forward's activations, where the peak is.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def _storage_users(tensor: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


# What the count reads for a tensor that is its storage's only user (the temporary Python storage object
# taken to read it may count too, depending on the torch version).
_SOLE_USER = _storage_users(torch.empty(1))

_Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Flat 1-D buffers by (numel, dtype, device): see [Note: buffer reuse]. Not thread-safe."""

    def __init__(self, keep_between_steps: int = 0) -> None:
        self.keep_between_steps = keep_between_steps
        self._idle: OrderedDict[int, tuple[_Key, torch.Tensor]] = OrderedDict()  # oldest first
        self._serial = 0
        self.idle_bytes = 0
        self.out_bytes = 0  # handed out and not given back
        self.high_water_bytes = 0
        self.hits = 0
        self.misses = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements with arbitrary contents (reused, or newly allocated)."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        key = (numel, dtype, device)
        nbytes = numel * dtype.itemsize
        self.out_bytes += nbytes
        self.high_water_bytes = max(self.high_water_bytes, self.out_bytes)
        for serial, (k, buf) in self._idle.items():
            if k == key:
                del self._idle[serial]
                self.idle_bytes -= nbytes
                self.hits += 1
                return buf
        self.misses += 1
        self._trim(self.high_water_bytes)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back a buffer from :meth:`take`; it is kept for reuse if nothing else refers to it."""
        if buffer.device.type != "cpu":
            return
        nbytes = buffer.numel() * buffer.element_size()
        self.out_bytes = max(0, self.out_bytes - nbytes)
        if _storage_users(buffer) != _SOLE_USER or buffer.storage_offset() != 0:
            return  # still in use elsewhere: the allocator frees it when the last user lets go
        if self.idle_bytes + nbytes > self.high_water_bytes:
            return  # not one of ours, or more idle than the pool ever handed out at once
        self._serial += 1
        self._idle[self._serial] = ((buffer.numel(), buffer.dtype, buffer.device), buffer)
        self.idle_bytes += nbytes

    def end_step(self) -> None:
        """Free idle buffers, oldest first, down to ``keep_between_steps`` bytes."""
        self._trim(self.keep_between_steps)

    def clear(self) -> None:
        """Free every idle buffer."""
        self._trim(0)

    def _trim(self, limit: int) -> None:
        while self._idle and self.idle_bytes > limit:
            _, (_, old) = self._idle.popitem(last=False)
            self.idle_bytes -= old.numel() * old.element_size()
