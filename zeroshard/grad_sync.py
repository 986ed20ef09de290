"""Gradient reduction: per-unit buckets, accumulation over micro-steps, all-reduce or reduce-scatter.

[Note: gradient flow]
A post-accumulate-grad hook on every trainable parameter moves the gradient autograd produced into the
parameter's unit and drops ``param.grad``, so autograd's full-size gradients never outlive one parameter.

* Stages that keep full gradients (0, 1) add it into ``unit.grad_full``; on the backward of an accumulation
  boundary, a unit whose parameters have all arrived is reduced (all-reduce at stage 0, reduce-scatter into
  this rank's slice at stage 1) while backward goes on.
* Stages that shard gradients (2, 3) copy it into a transient bucket the size of the unit; when the bucket is
  complete it is reduce-scattered and this rank's slice is added into ``unit.grad_shard`` (fp32 accumulation
  over micro-steps), and the bucket is dropped.

Collectives must be issued in the same order on every rank even though gradients may become ready in a
different order, or not at all (an unused parameter): units are launched in a fixed order (reverse
registration order, which is roughly the order backward produces them), a ready unit waits for the units
before it, and :meth:`GradientReducer.finish_backward` launches whatever is left. With ``overlap_comm`` the
launched collectives run while backward continues and are waited for at the end of backward at the latest.
Buckets come from, and go back to, the engine's :class:`~zeroshard.buffers.BufferPool`;
``peak_bucket_bytes`` counts those filling and those in flight.

Averaging follows DeepSpeed: with ``prescale_gradients`` gradients are divided by
``gradient_predivide_factor`` before the reduction and by ``world_size / predivide`` after it; otherwise the
sum is divided by ``world_size`` after it.

[Note: bounded reductions]
A bucket in flight is memory: left alone, every bucket of a stage-3 backward would live until its end, the
whole model's gradients (the point-to-point exchanges of comm.py hold their buffers until waited for). So
once more than ``MAX_INFLIGHT`` reductions are in flight the oldest is waited for, but only once every rank
is known to have launched it. Waiting for one that a peer has not launched can deadlock: a peer whose unit
lacks a gradient (a parameter unused on that rank) launches it only at the end of its backward, which may
need this rank's next parameter gather. So each launch also launches a tiny collective, a marker, on the
same group; a marker completes only when every rank has launched its reduction, and completion is polled,
never waited for. Every rank launches the same markers in the same order (one per unit reduction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.buffers import BufferPool
from zeroshard.comm import Agreement, Comm, Pending
from zeroshard.flat_param import FlatUnit
from zeroshard.stages import StagePlan

# With overlap_comm, how many unit reductions may stay in flight while backward goes on, beyond which the
# oldest is waited for when that is safe ([Note: bounded reductions]).
MAX_INFLIGHT = 2


@dataclass(frozen=True)
class Averaging:
    world_size: int
    prescale: bool = False
    predivide_factor: float = 1.0

    @property
    def before(self) -> float:
        return 1.0 / self.predivide_factor if self.prescale else 1.0

    @property
    def after(self) -> float:
        return self.predivide_factor / self.world_size if self.prescale else 1.0 / self.world_size


class GradientReducer:
    """Owns the gradient hooks and the reduction schedule of a list of units.

    Collective: :meth:`finish_backward` and :meth:`global_has_grad` must be called on all ranks.
    """

    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Comm,
        plan: StagePlan,
        averaging: Averaging,
        *,
        overlap_comm: bool,
        pool: BufferPool,
    ) -> None:
        self.units = list(units)
        self.pool = pool  # the units' own pool: buckets and reduce-scatter outputs share it
        self.comm = comm
        self.plan = plan
        self.averaging = averaging
        self.overlap_comm = overlap_comm
        # Launch order: reverse registration order (see [Note: gradient flow]).
        self._order = sorted(self.units, key=lambda u: -u.index)
        self._position = {u.index: i for i, u in enumerate(self._order)}
        self._arrived = [0] * len(self.units)
        self._ready = [False] * len(self.units)
        self._next = 0
        self._buckets: dict[int, torch.Tensor] = {}
        self._filled: dict[int, list[int]] = {}  # per bucket, the parameters written into it
        # Reductions launched and not yet waited for: (the marker that completes once every rank has
        # launched it, pending, what to do when done, bucket bytes held); see [Note: bounded reductions].
        self._inflight: list[tuple[Agreement | None, Pending, Callable[[], None], int]] = []
        self._inflight_bytes = 0
        self._reducing = False
        self.needs_reduction = False  # gradients accumulated that no reduction has covered yet
        self.peak_bucket_bytes = 0
        self._handles: list[RemovableHandle] = []
        # Called right after a unit's gradients are handed to the reduction (stage 3 frees its parameters).
        self.on_reduced: Callable[[FlatUnit], None] | None = None

    # -- hooks ---------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        for unit in self.units:
            for i, param in enumerate(unit.params):
                self._handles.append(param.register_post_accumulate_grad_hook(self._make_hook(unit, i)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_hook(self, unit: FlatUnit, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:
                return
            param.grad = None
            self._accumulate(unit, i, grad)

        return hook

    # -- one backward --------------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Start a backward; ``reduce`` says whether this backward's gradients are reduced (boundary)."""
        self._reducing = reduce or self.plan.reduce_every_micro_step
        self._arrived = [0] * len(self.units)
        self._ready = [False] * len(self.units)
        self._next = 0

    def _accumulate(self, unit: FlatUnit, i: int, grad: torch.Tensor) -> None:
        lo, hi = unit.param_range(i)
        flat = grad.reshape(-1)
        if unit.grad_full is not None:
            unit.grad_full[lo:hi].add_(flat)
        else:
            bucket = self._buckets.get(unit.index)
            if bucket is None:
                bucket = self._new_bucket(unit)
                self._buckets[unit.index] = bucket
                self._track_bucket_bytes()
            bucket[lo:hi].copy_(flat)
            self._filled[unit.index].append(i)
        unit.has_grad[i] = True
        self.needs_reduction = True
        self._arrived[unit.index] += 1
        if self._reducing and self._arrived[unit.index] == len(unit.params):
            self._ready[self._position[unit.index]] = True
            self._launch_ready()

    def comm_dtype(self, unit: FlatUnit) -> torch.dtype:
        return unit.policy.reduce

    def _new_bucket(self, unit: FlatUnit) -> torch.Tensor:
        """A bucket for ``unit`` (from the pool: contents arbitrary) whose padding is zero; the parameters'
        ranges are written as their gradients arrive, and :meth:`_complete` zeroes the ones that did not."""
        bucket = self.pool.take(unit.layout.padded, self.comm_dtype(unit), unit.full.device)
        bucket[unit.layout.total :].zero_()
        self._filled[unit.index] = []
        return bucket

    def _complete(self, unit: FlatUnit, bucket: torch.Tensor) -> None:
        """Zero the ranges of ``bucket`` that no gradient was written into in this backward."""
        filled = self._filled.pop(unit.index, [])
        if len(set(filled)) == len(unit.params):
            return
        for i in sorted(set(range(len(unit.params))) - set(filled)):
            lo, hi = unit.param_range(i)
            bucket[lo:hi].zero_()

    def _track_bucket_bytes(self) -> None:
        filling = sum(b.numel() * b.element_size() for b in self._buckets.values())
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, filling + self._inflight_bytes)

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._ready[self._next]:
            self._launch(self._order[self._next])
            self._next += 1

    def finish_backward(self) -> None:
        """Reduce every unit not yet reduced in this backward and wait for all reductions.

        Collective: call on all ranks after every backward.
        """
        if self._reducing:
            while self._next < len(self._order):
                self._launch(self._order[self._next])
                self._next += 1
            self.needs_reduction = False
        self.wait_all()
        self._reducing = False

    def wait_all(self) -> None:
        while self._inflight:
            self._retire_oldest()

    def _retire_oldest(self) -> None:
        marker, pending, then, nbytes = self._inflight.pop(0)
        pending.wait()
        if marker is not None:
            marker.result()  # done already, or (at the end of backward) about to be
        then()
        self._inflight_bytes -= nbytes

    def _retire_safely(self) -> None:
        """Wait for the oldest reductions beyond ``MAX_INFLIGHT`` that every rank has launched."""
        while len(self._inflight) > MAX_INFLIGHT:
            marker = self._inflight[0][0]
            if marker is not None and not marker.done():
                return
            self._retire_oldest()

    # -- one unit's reduction ------------------------------------------------------------------------
    def _launch(self, unit: FlatUnit) -> None:
        before, after = self.averaging.before, self.averaging.after
        what = f"gradient {self.plan.reduce_op} of unit {unit.index} ({unit.names[0]}, ...)"
        reduce_dtype = self.comm_dtype(unit)
        if unit.grad_full is not None:
            # Kept full gradients (stages 0, 1): reduce them at the boundary, in the reduce dtype.
            kept = unit.grad_full
            full = kept if kept.dtype == reduce_dtype else kept.to(reduce_dtype)
        else:
            bucket = self._buckets.pop(unit.index, None)
            if bucket is None:  # no parameter of this unit got a gradient on this rank
                bucket = self._new_bucket(unit)
            self._complete(unit, bucket)
            full = bucket
        if before != 1.0:
            full.mul_(before)
        if not self.plan.shard_optimizer:
            kept_full = unit.grad_full
            if kept_full is None:
                raise RuntimeError(
                    f"rank {self.comm.rank}: unit {unit.index} has no full gradient buffer to all-reduce"
                )
            pending = self.comm.all_reduce(full, what=what)
            kept = kept_full

            def then() -> None:
                if full is not kept:
                    kept.copy_(full)
                kept.mul_(after)

        else:
            out = self.pool.take(unit.layout.shard_size, reduce_dtype, full.device)
            pending = self.comm.reduce_scatter(out, full, what=what)
            accumulate = unit.grad_full is None  # sharded gradients sum over micro-steps
            pooled = full if unit.grad_full is None else None

            def then() -> None:
                if accumulate:
                    unit.grad_shard.add_(out.to(unit.grad_shard.dtype), alpha=after)
                else:
                    unit.grad_shard.copy_(out).mul_(after)
                self.pool.give(out)
                if pooled is not None:
                    self.pool.give(pooled)

        held = full.numel() * full.element_size() if unit.grad_full is None else 0
        marker = None
        if self.overlap_comm and held:
            marker = self.comm.agree_async([self._next], what=f"reduction marker of unit {unit.index}")
        self._inflight.append((marker, pending, then, held))
        self._inflight_bytes += held
        self._track_bucket_bytes()
        if self.on_reduced is not None:
            self.on_reduced(unit)
        if not self.overlap_comm:
            self.wait_all()
        self._retire_safely()

    # -- the accumulation boundary -------------------------------------------------------------------
    def global_has_grad(self) -> list[torch.Tensor]:
        """Per unit, which parameters got a gradient on any rank in any micro-step since the last zero.

        Collective: call on all ranks.
        """
        flags = (
            torch.cat([u.has_grad for u in self.units]) if self.units else torch.zeros(0, dtype=torch.bool)
        )
        merged = self.comm.any_true(flags)
        return list(torch.split(merged, [len(u.params) for u in self.units]))

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()
        self._buckets.clear()
        self._filled.clear()
        self.needs_reduction = False
