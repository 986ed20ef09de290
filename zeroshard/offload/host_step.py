"""ZeRO-Offload's step beside a GPU, overlapped: gradients leave during the backward, parameters go back while
the CPU steps the next sub-group.

[Note: overlapped offload step]
With the masters in CPU memory ([Note: offload beside a device]) one step is:

1. During the backward of an accumulation boundary, as each reduction writes a unit's final gradient
   shard, the reducer calls :meth:`HostStep.grads_ready` and the shard starts its copy into a pinned CPU
   buffer of the unit's ([Note: copy streams]), beside the backward's remaining kernels.
2. The overflow check and the global norm read the gradient shards where they are, on the GPU, as
   without offload (``ShardedStep.checks``); so clipping and the loss scale need no second pass over the
   CPU copies, and their values are the same.
3. :meth:`HostStep.step` steps the masters one sub-group at a time (at most ``STEP_ELEMENTS`` elements at
   piece boundaries, [Note: sub-group stepping]): wait for that unit's gradient copy, apply the
   unscale/clip factor, step, and hand the stepped values to the unit's store, which casts them and starts
   their copy to the GPU (or writes the CPU parameter shard) while the CPU steps the next sub-group.
4. The stores are flushed: the GPU waits for the last copies before the post-step all-gather and the next
   forward read them.

A gradient copy started early stands only while the shard is unchanged: every write to a gradient shard
bumps ``FlatUnit.grad_version``, and a copy whose version is behind is made again at the step. Stepping
per sub-group gives the values of one call over all slices for every elementwise optimizer (torch skips a
parameter whose ``.grad`` is None); an optimizer of a class zeroshard does not know to be elementwise is
stepped once, after every gradient is in. :attr:`HostStep.timings` holds where the last step's time went.

Local: no collectives.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from zeroshard.core.copies import Copies, Copy
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.offload.host_shards import host_empty
from zeroshard.offload.swapper import SubGroup, split_sub_groups

STEP_ELEMENTS = 1 << 25
"""Master elements stepped per sub-group (128 MiB of fp32 masters): the copy of one sub-group's stepped
parameters to the GPU runs while the next is stepped. ``sub_group_size`` makes it smaller."""

ELEMENTWISE_MODULES = ("torch.optim", "zeroshard.optimizers", "zeroshard.deepspeed.ops", "deepspeed.ops")
"""Where the optimizer classes come from that may be stepped one sub-group at a time."""


def steps_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s class is one known to update each parameter on its own."""
    module = type(optimizer).__module__
    return any(module == m or module.startswith(m + ".") for m in ELEMENTWISE_MODULES)


class HostStep:
    """The optimizer step over masters in CPU memory beside a GPU ([Note: overlapped offload step]).

    Life cycle: :meth:`adopt` each unit as it is built, :meth:`bind` the optimizer's slices, then per step
    :meth:`grads_ready` (the reducer, during the backward) and :meth:`step` (``ShardedStep.run``).
    """

    def __init__(self, copies: Copies, sub_group_size: int, pin: bool) -> None:
        self.copies = copies
        self.sub_group_size = min(max(1, sub_group_size), STEP_ELEMENTS)
        self.pin = pin
        self.groups: list[SubGroup] = []
        self.units: list[FlatUnit] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._host_grads: dict[int, torch.Tensor] = {}  # per unit: its gradient shard's pinned copy
        self._copying: dict[int, tuple[int, Copy]] = {}  # per unit: the version its copy holds, the copy
        self.timings: dict[str, float] = {}

    def adopt(self, unit: FlatUnit) -> None:
        self.units.append(unit)
        self.groups.extend(split_sub_groups(unit, self.sub_group_size, len(self.groups)))

    def bind(self, slices: Sequence[OptimizerSlice], optimizer: torch.optim.Optimizer) -> None:
        """Attach the optimizer's slices to their sub-groups (slices of parameters in no group stay out)."""
        self.optimizer = optimizer
        by_piece = {(sl.unit.index, sl.piece.index): sl for sl in slices}
        for g in self.groups:
            keys = [(g.unit.index, piece.index) for piece in g.pieces]
            g.slices = [by_piece[k] for k in keys if k in by_piece]

    # -- the backward --------------------------------------------------------------------------------
    def grads_ready(self, unit: FlatUnit) -> None:
        """``unit``'s gradient shard holds this step's values (as of now): start its copy to the CPU."""
        grad = unit.grad_shard
        host = self._host_grads.get(unit.index)
        if host is None or host.dtype != grad.dtype:
            host = self._host_grads[unit.index] = host_empty(grad.numel(), grad.dtype, self.pin)
        previous = self._copying.pop(unit.index, None)
        if previous is not None:
            previous[1].wait()  # its destination is written again now
        self._copying[unit.index] = (unit.grad_version, self.copies.start(host, grad))

    def _host_grad(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s gradient shard on the CPU, as it is now (copied again if it changed since)."""
        copying = self._copying.get(unit.index)
        if copying is None or copying[0] != unit.grad_version:
            self.grads_ready(unit)
        self._copying[unit.index][1].wait()
        return self._host_grads[unit.index]

    # -- the step ------------------------------------------------------------------------------------
    def step(self, grads: dict[int, torch.Tensor | None], factor: float = 1.0) -> None:
        """Step every sub-group with ``grads`` (keyed by ``id`` of a slice's master; None or absent skips),
        each gradient multiplied by ``factor``; the stepped masters go into the parameters through the
        units' stores, which are flushed at the end."""
        opt = self.optimizer
        if opt is None:
            raise RuntimeError("the offloaded step has no optimizer bound")
        timings = {"grad_copy_wait_s": 0.0, "cpu_step_s": 0.0, "param_copy_wait_s": 0.0}
        per_group = steps_elementwise(opt)
        collected: list[SubGroup] = []
        for g in self.groups:
            used = [sl for sl in g.slices if grads.get(id(sl.master)) is not None]
            if not used:
                continue
            start = time.perf_counter()
            host = self._host_grad(g.unit)[g.start : g.start + g.numel]
            timings["grad_copy_wait_s"] += time.perf_counter() - start
            start = time.perf_counter()
            master_dtype = used[0].master.dtype
            part = host if host.dtype == master_dtype else host.to(master_dtype)
            if factor != 1.0:
                part.mul_(factor)  # the CPU copy is this step's alone (forgotten below)
            for sl in used:
                offset = sl.piece.shard_start - g.start
                sl.master.grad = part[offset : offset + sl.piece.numel]
            collected.append(g)
            if per_group:
                self._step(opt, collected)
                collected = []
            timings["cpu_step_s"] += time.perf_counter() - start
        start = time.perf_counter()
        if collected:
            self._step(opt, collected)
        timings["cpu_step_s"] += time.perf_counter() - start
        for _, copy in self._copying.values():  # the CPU copies were scaled in place: forget them all
            copy.wait()
        self._copying.clear()
        start = time.perf_counter()
        for unit in self.units:
            unit.store.flush()
        timings["param_copy_wait_s"] = time.perf_counter() - start
        self.timings = timings

    @staticmethod
    def _step(opt: torch.optim.Optimizer, groups: list[SubGroup]) -> None:
        """Step the slices of ``groups`` (their gradients attached) and hand the stepped masters on."""
        opt.step()
        for g in groups:
            for sl in g.slices:
                sl.master.grad = None
            g.unit.master_to_full(g.unit.master[g.start : g.start + g.numel], g.start)

    def close(self) -> None:
        """Wait for copies in flight and drop the pinned buffers."""
        for _, copy in self._copying.values():
            copy.wait()
        self._copying.clear()
        self._host_grads.clear()
