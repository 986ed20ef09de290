"""ZeRO-Offload's step beside a GPU, overlapped: gradients leave during the backward, parameters go back while
the CPU steps the next sub-group.

[Note: overlapped offload step]
With the masters in CPU memory ([Note: offload beside a device]) one step is:

1. During the backward of an accumulation boundary, as each reduction writes a unit's final gradient
   shard, the reducer calls :meth:`HostStep.grads_ready`: on the GPU it takes the fp32 norm of each of the
   unit's parameter pieces and whether the shard is finite (a few small kernels), then starts the shard's
   copy into a pinned CPU buffer ([Note: copy streams]), beside the backward's remaining kernels. At
   stages 2-3 the shard then lives in that buffer (``FlatUnit.move_grad_shard``): its GPU memory goes as
   soon as the copy has read it, so the gradients of the whole model never sit on the GPU together.
2. The overflow check and the global norm combine those partial results (``ShardedStep.checks``, through
   :meth:`HostStep.grad_partials`): the same per-piece norms, in the same order, as without offload, so
   clipping and the loss scale see the same values and need no pass over the CPU copies. A shard changed
   after its partials were taken (a second backward before the step, a gradient set by hand) is read
   again where it lives.
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
from zeroshard.core.slice_norms import piece_norms, slices_by_unit
from zeroshard.offload.host_shards import host_empty
from zeroshard.offload.swapper import SubGroup, attach_slices, split_sub_groups

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
        self._partials: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # version, norms, finite
        self._unit_slices: dict[int, list[OptimizerSlice]] = {}
        self.timings: dict[str, float] = {}

    def adopt(self, unit: FlatUnit) -> None:
        self.units.append(unit)
        self.groups.extend(split_sub_groups(unit, self.sub_group_size, len(self.groups)))

    def bind(self, slices: Sequence[OptimizerSlice], optimizer: torch.optim.Optimizer) -> None:
        """Attach the optimizer's slices to their sub-groups (slices of parameters in no group stay out)."""
        self.optimizer = optimizer
        self._unit_slices = slices_by_unit(slices)
        attach_slices(self.groups, slices)

    # -- the backward --------------------------------------------------------------------------------
    def grads_ready(self, unit: FlatUnit) -> None:
        """``unit``'s gradient shard holds this step's values (as of now): take the partial norms and the
        overflow flag the step's checks need, and start its copy to the CPU; at stages 2-3 the shard moves
        there (``FlatUnit.move_grad_shard``) and its GPU memory goes."""
        grad = unit.peek_grad_shard()
        host = self._host_grads.get(unit.index)
        if grad is host:  # moved already, and added to since (a second backward before the step)
            self._partials[unit.index] = (unit.grad_version, *self._partials_of(unit, unit.grad_shard))
            return
        self._partials[unit.index] = (unit.grad_version, *self._partials_of(unit, grad))
        if host is None or host.dtype != grad.dtype or host.numel() != grad.numel():
            host = self._host_grads[unit.index] = host_empty(grad.numel(), grad.dtype, self.pin)
        previous = self._copying.pop(unit.index, None)
        if previous is not None:
            previous[1].wait()  # its destination is written again now
        copy = self.copies.start(host, grad)
        self._copying[unit.index] = (unit.grad_version, copy)
        if not unit.keeps_full_grad:
            unit.move_grad_shard(host, copy)

    def _partials_of(self, unit: FlatUnit, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 norm of each of ``unit``'s optimizer pieces in ``grad`` (in slice order, empty pieces
        left out, as ``ShardedStep`` takes them) and whether ``grad`` is finite, where ``grad`` lives."""
        return piece_norms(grad, self._unit_slices.get(unit.index, ())), torch.isfinite(grad).all()

    def grad_partials(self, unit: FlatUnit) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The partial norms and finite flag :meth:`grads_ready` took of ``unit``'s gradient shard, if the
        shard has not changed since."""
        taken = self._partials.get(unit.index)
        if taken is None or taken[0] != unit.grad_version:
            return None
        return taken[1], taken[2]

    def _host_grad(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s gradient shard on the CPU, as it is now (copied again if it changed since a copy that
        did not move it)."""
        if unit.peek_grad_shard() is not self._host_grads.get(unit.index):
            copying = self._copying.get(unit.index)
            if copying is None or copying[0] != unit.grad_version:
                self.grads_ready(unit)
        if unit.peek_grad_shard() is self._host_grads.get(unit.index):
            return unit.grad_shard  # the shard lives there: waits for it to land
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
        self._forget_copies()  # the CPU copies were scaled in place
        self._partials.clear()
        start = time.perf_counter()
        for unit in self.units:
            unit.store.flush()
        timings["param_copy_wait_s"] = time.perf_counter() - start
        self.timings = {**timings, **self.copies.take_times()}

    @staticmethod
    def _step(opt: torch.optim.Optimizer, groups: list[SubGroup]) -> None:
        """Step the slices of ``groups`` (their gradients attached) and hand the stepped masters on."""
        opt.step()
        for g in groups:
            for sl in g.slices:
                sl.master.grad = None
            g.unit.master_to_full(g.unit.master[g.start : g.start + g.numel], g.start)

    def _forget_copies(self) -> None:
        """Wait for the gradient copies in flight and forget them all."""
        for _, copy in self._copying.values():
            copy.wait()
        self._copying.clear()

    def close(self) -> None:
        """Wait for copies in flight and drop the pinned buffers."""
        self._forget_copies()
        self._host_grads.clear()
