"""Gradient reduction: shared buckets, accumulation over micro-steps, all-reduce or reduce-scatter.

[Note: gradient flow]
A post-accumulate-grad hook on every trainable parameter moves the gradient autograd produced into the
parameter's unit and drops ``param.grad``, so autograd's full-size gradients never outlive one parameter.

* Stages that keep full gradients (0, 1) add it into ``unit.grad_full``; on the backward of an accumulation
  boundary, a unit whose parameters have all arrived is reduced (all-reduce at stage 0, reduce-scatter into
  this rank's slice at stage 1) while backward goes on.
* Stages that shard gradients (2, 3) copy it into a transient bucket shared by a *reduction group*:
  consecutive units (in launch order) of at most ``reduce_bucket_size`` elements together, DeepSpeed's
  bucket. When every unit of the group is complete the bucket is reduce-scattered, each unit's part of this
  rank's slice is added into its ``unit.grad_shard`` (fp32 accumulation over micro-steps), and the bucket
  is dropped. The bucket is laid out rank by rank so that one collective serves the whole group
  (layout.py, [Note: coalesced reduction]); a unit larger than the bucket size is a group of its own, and
  no group is larger than the largest unit or ``SMALL_BUCKET_ELEMENTS``, whichever is larger (so stage 2's
  bucket-sized units are one to a group). A group that is exactly one
  parameter without padding (a large embedding) takes autograd's gradient itself as its bucket when nothing
  else holds it: no bucket beside a gradient of the same size, no copy. At stage 3 a unit's
  parameters are released as soon as its gradients are in the bucket, not when the bucket is reduced.

Collectives must be issued in the same order on every rank even though gradients may become ready in a
different order, or not at all (an unused parameter): groups are launched in a fixed order (reverse
registration order, which is roughly the order backward produces them), a ready group waits for the groups
before it, and :meth:`GradientReducer.finish_backward` launches whatever is left. With ``overlap_comm`` the
launched collectives run while backward continues and are waited for at the end of backward at the latest.
Buckets come from, and go back to, the engine's :class:`~zeroshard.core.buffers.BufferPool`;
``peak_bucket_bytes`` counts those filling and those in flight.

Averaging follows DeepSpeed: with ``prescale_gradients`` gradients are divided by
``gradient_predivide_factor`` before the reduction and by ``world_size / predivide`` after it; otherwise the
sum is divided by ``world_size`` after it.

How many reductions stay in flight, and which may be waited for before the backward ends:
``inflight.py``, [Note: bounded reductions].

With hybrid sharding the units are sharded over a shard group, and the backward of an accumulation boundary
ends with an all-reduce of the gradient shards over the replica group (hybrid.py [Note: hybrid sharding]).

[Note: repeated gradients]
The post-accumulate hook runs once per ``AccumulateGrad`` execution, which is once per backward for a
parameter, however many times the forward used it, except where a backward runs inside the backward:
reentrant activation checkpointing (``torch.utils.checkpoint(use_reentrant=True)``, DeepSpeed's
``checkpointing.checkpoint``) differentiates each region in a backward of its own, so a parameter used in
two regions, or in one and outside it, gets one gradient from each. A unit counts as complete once each of
its parameters has arrived once; a repeat before that is added to the first, and a repeat after the unit
went to its reduction (whose result no longer can include it) raises an error naming the parameter, as DDP
and DeepSpeed do, instead of dropping the gradient or adding it into a buffer being reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.hooks import RemovableHandle

from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.grad_buckets import GradientBuckets
from zeroshard.core.hybrid import all_reduce_grad_shards
from zeroshard.core.inflight import MAX_INFLIGHT, InFlight
from zeroshard.core.layout import GroupLayout
from zeroshard.core.quantize import reduce_scatter_for
from zeroshard.core.reduction_groups import Averaging, ReductionGroup, group_units, reentrant_reuse_error
from zeroshard.core.stage3.coupling import ParameterSide
from zeroshard.core.stages import StagePlan

# Units smaller than this share a reduction group up to this many elements (4 MiB of fp32 gradients),
# within reduce_bucket_size: each reduce-scatter's fixed cost is paid once for many small modules.
SMALL_BUCKET_ELEMENTS = 1 << 20


class GradientReducer:
    """Owns the gradient hooks and the reduction schedule of a list of units.

    ``bucket_elements`` (``reduce_bucket_size``, at most ``units.MAX_UNIT_ELEMENTS``: ``build.initialize``)
    bounds how many elements of consecutive units' transient buckets are reduced in one collective ([Note:
    coalesced reduction]), and so does the largest unit. ``params`` is told when a unit's gradients are
    reduced and says whether backward gathers; ``inflight`` holds the launched reductions, which the stage-3
    gatherer may retire too ([Note: reducer and gatherer]). ``replica`` (hybrid sharding only) is the group
    the boundary's gradient shards are all-reduced over ([Note: hybrid sharding] in hybrid.py). With
    ``quantized`` the reduce-scatters send int8 (quantize.py [Note: quantized collectives]).

    Collective: :meth:`finish_backward` must be called on all ranks.
    """

    on_final_grads: Callable[[FlatUnit], None] | None = None
    """Told each unit whose gradient shard holds its final value for the coming step, as soon as its
    reduction is done (offload/host_step.py [Note: overlapped offload step])."""

    def __init__(
        self,
        units: Sequence[FlatUnit],
        comm: Comm,
        plan: StagePlan,
        averaging: Averaging,
        *,
        overlap_comm: bool,
        pool: BufferPool,
        bucket_elements: int,
        params: ParameterSide,
        inflight: InFlight,
        replica: Comm | None = None,
        quantized: bool = False,
    ) -> None:
        self.units = list(units)
        self.replica = replica
        self._reduce_scatter = reduce_scatter_for(comm, quantized)
        # Whether the gradient shards hold the replica group's sum since the last zero_grad (a second
        # boundary backward before the step first takes them back to this shard group's part).
        self._replicated = False
        self._boundary = False
        self.pool = pool  # the units' own pool: buckets and reduce-scatter outputs share it
        self.comm = comm
        self.plan = plan
        self.averaging = averaging
        self.overlap_comm = overlap_comm
        self.params = params
        # Launch order: reverse registration order (see [Note: gradient flow]), in groups.
        order = sorted(self.units, key=lambda u: -u.index)
        # No group's bucket is larger than the largest unit's, or SMALL_BUCKET_ELEMENTS where every unit is
        # smaller: coalescing merges small units, it never raises the bucket memory that reducing unit by
        # unit needs anyway by more than a few MiB, and a model of small modules pays fewer collectives.
        largest = max((u.layout.padded for u in self.units if not u.keeps_full_grad), default=0)
        bucket_elements = min(bucket_elements, max(largest, SMALL_BUCKET_ELEMENTS))
        self.groups = [
            ReductionGroup(g, tuple(us), GroupLayout(tuple(u.layout.shard_size for u in us), comm.world_size))
            for g, us in enumerate(group_units(order, max(1, bucket_elements)))
        ]
        self._group_of = {u.index: g.index for g in self.groups for u in g.units}
        self._buckets = GradientBuckets(self.groups, pool, self.comm_dtype, prescaled=averaging.before != 1.0)
        # Per unit, its parameters that got a gradient in this backward.
        self._arrived: list[set[int]] = [set() for _ in self.units]
        self._complete_units = [0] * len(self.groups)
        self._handed = [False] * len(self.units)  # on_reduced called in this backward
        self._next = 0
        self._inflight = inflight  # reductions launched and not yet waited for
        self._reducing = False
        # Between begin_backward and finish_backward (this engine's backward). Gradients that arrive at
        # other times, e.g. a second engine's loss backpropagated through this engine's model (a GAN's
        # generator loss through the discriminator), stay in param.grad exactly as PyTorch leaves them:
        # `module.zero_grad()` clears them, and otherwise the next backward adds to them.
        self._in_backward = False
        # Whether kept full gradients (stage 1) were reduce-scattered since the last zero_grad: their shard
        # then holds an average, see _unreduce_kept_slices.
        self._window_reduced = False
        self.needs_reduction = False  # gradients accumulated that no reduction has covered yet
        self.peak_bucket_bytes = 0
        self._handles: list[RemovableHandle] = []

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
            if grad is None or not self._in_backward:
                return  # a backward this engine did not start: the gradient stays in .grad, as in PyTorch
            param.grad = None
            self._accumulate(unit, i, grad, adoptable=True)  # nothing but autograd's hook saw it

        return hook

    def take_plain_gradients(self, factor: float) -> None:
        """Move every ``param.grad`` (left by a backward this engine did not run) into the units, times
        ``factor``, as the hooks would have. Call between :meth:`begin_backward` and
        :meth:`finish_backward`."""
        for unit in self.units:
            for i, param in enumerate(unit.params):
                grad = param.grad
                if grad is not None:
                    param.grad = None
                    self._accumulate(unit, i, grad * factor if factor != 1.0 else grad)

    # -- one backward --------------------------------------------------------------------------------
    def begin_backward(self, reduce: bool) -> None:
        """Start a backward; ``reduce`` says whether this backward's gradients are reduced (boundary)."""
        self._reducing = reduce or self.plan.reduce_every_micro_step
        self._boundary = reduce
        if self._reducing and self._replicated:
            self._unreplicate()
        self._arrived = [set() for _ in self.units]
        self._in_backward = True
        self._complete_units = [0] * len(self.groups)
        self._handed = [False] * len(self.units)
        self._next = 0
        if self._reducing and self._window_reduced:
            self._unreduce_kept_slices()

    def _unreduce_kept_slices(self) -> None:
        """A second reducing backward before the step (e.g. a GAN discriminator's real and fake losses):
        make the kept full gradients (stage 1) this rank's contribution to a sum again.

        After a reduce-scatter, this rank's slice of ``grad_full`` holds the reduced average (it is the
        gradient shard) and the rest still holds local gradients that are already counted. Scaling the slice
        back to the (prescaled) sum and zeroing the rest makes the next reduction give the average of both
        backwards, as if they had been one. (Stage 0's all-reduce needs nothing: its average is the same on
        every rank, so it is reduced again to itself.)
        """
        undo = 1.0 / (self.averaging.before * self.averaging.after)
        for unit in self.units:
            if unit.grad_full is not None and unit.plan.shard_optimizer:
                lo = unit.layout.shard_range(self.comm.rank)[0]
                hi = lo + unit.grad_shard.numel()
                unit.grad_full[:lo].zero_()
                unit.grad_full[hi:].zero_()
                unit.grad_shard.mul_(undo)
                unit.grad_written()
                unit.grad_reduced = False
        self._window_reduced = False

    def _unreplicate(self) -> None:
        """Take replicated gradient shards (the world's average) back to this shard group's part of it,
        so that the next replica all-reduce counts them once."""
        replicas = self.replica.world_size if self.replica is not None else 1
        for unit in self.units:
            if unit.grad_reduced:
                unit.grad_shard.div_(replicas)
                unit.grad_written()
        self._replicated = False

    def _accumulate(self, unit: FlatUnit, i: int, grad: torch.Tensor, adoptable: bool = False) -> None:
        """Add parameter ``i``'s gradient into ``unit``'s accumulator or its group's bucket; with
        ``adoptable`` (no one else can hold ``grad``) it may become the bucket itself (``grad_buckets.py``).

        A parameter's gradient may arrive more than once in one backward ([Note: repeated gradients]): the
        arrivals are summed, and one after the unit went to its reduction is an error."""
        if self._handed[unit.index] and self._reducing:
            what = f"parameter {unit.names[i]!r} got a second gradient"
            raise reentrant_reuse_error(self.comm.rank, unit, what)
        g = self._group_of[unit.index]
        arrived = self._arrived[unit.index]
        repeat = i in arrived
        if unit.keeps_full_grad:
            lo, hi = unit.param_range(i)
            unit.kept_grad()[lo:hi].add_(grad.reshape(-1))
            unit.grad_written()
        elif self._buckets.write(self.groups[g], unit, i, grad, adoptable=adoptable, repeat=repeat):
            self._track_bucket_bytes()
        unit.has_grad[i] = True
        self.needs_reduction = True
        if repeat:
            return
        arrived.add(i)
        if self._reducing and len(arrived) == len(unit.params):
            self._hand_over(unit)
            self._complete_units[g] += 1
            self._launch_ready()

    def comm_dtype(self, unit: FlatUnit) -> torch.dtype:
        return unit.policy.reduce

    def _hand_over(self, unit: FlatUnit) -> None:
        if not self._handed[unit.index]:
            self._handed[unit.index] = True
            self.params.on_reduced(unit)

    def _track_bucket_bytes(self) -> None:
        filling = self._buckets.filling_bytes
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, filling + self._inflight.bytes)

    def _launch_ready(self) -> None:
        while self._next < len(self.groups) and self._complete_units[self._next] == len(
            self.groups[self._next].units
        ):
            self._launch(self.groups[self._next])
            self._next += 1

    def finish_backward(self) -> None:
        """Reduce every unit not yet reduced in this backward and wait for all reductions.

        Collective: call on all ranks after every backward.
        """
        if self._reducing:
            while self._next < len(self.groups):
                self._launch(self.groups[self._next])
                self._next += 1
            self.needs_reduction = False
        self.wait_all()
        if self._reducing and self._boundary and self.replica is not None:
            chunk = max((g.layout.chunk for g in self.groups), default=1)
            all_reduce_grad_shards(self.units, self.replica, max(1, chunk))
            self._replicated = True
        self._reducing = False
        self._in_backward = False

    def wait_all(self) -> None:
        self._inflight.wait_all()

    # -- one group's reduction -----------------------------------------------------------------------
    def _launch(self, group: ReductionGroup) -> None:
        before, after = self.averaging.before, self.averaging.after
        first = group.units[0]
        names = f"unit {first.index} ({first.names[0]}, ...)"
        if len(group.units) > 1:
            names = f"units {first.index}-{group.units[-1].index} ({first.names[0]}, ...)"
        what = f"gradient {self.plan.reduce_op} of {names}"
        reduce_dtype = self.comm_dtype(first)
        if first.keeps_full_grad:
            # Kept full gradients (stages 0, 1): reduce them at the boundary, in the reduce dtype.
            kept = first.kept_grad()
            full = kept if kept.dtype == reduce_dtype else kept.to(reduce_dtype)
            adopted = False
        else:
            full, adopted = self._buckets.take(group)
        if before != 1.0:
            full.mul_(before)
        if not self.plan.shard_optimizer:
            kept_full = first.grad_full
            if kept_full is None:
                raise RuntimeError(
                    f"rank {self.comm.rank}: unit {first.index} has no full gradient buffer to all-reduce"
                )
            pending = self.comm.all_reduce(full, what=what)
            kept = kept_full

            def then() -> None:
                if full is not kept:
                    kept.copy_(full)
                kept.mul_(after)
                for unit in group.units:
                    unit.grad_written()
                    unit.grad_reduced = True

        else:
            out = self.pool.take(group.layout.chunk, reduce_dtype, full.device)
            pending = self._reduce_scatter(out, full, what=what)
            accumulate = not group.keeps_full  # sharded gradients sum over micro-steps
            # The boundary's reductions write each unit's final gradient shard (no replica all-reduce after).
            final = self.on_final_grads if self._boundary and self.replica is None else None
            pooled = None if group.keeps_full or adopted else full
            placed = list(zip(group.units, group.layout.offsets, strict=True))

            self._window_reduced = self._window_reduced or group.keeps_full

            def then() -> None:
                # Views of ``out`` live only within each statement: the pool reuses ``out`` only if nothing
                # else refers to its storage.
                for unit, offset in placed:
                    n = unit.layout.shard_size
                    if accumulate:
                        unit.add_reduced_grad(out.narrow(0, offset, n), after)
                    else:
                        unit.grad_shard.copy_(out.narrow(0, offset, n)).mul_(after)
                        unit.grad_written()
                    unit.grad_reduced = True
                    if final is not None:
                        final(unit)
                self.pool.give(out)
                if pooled is not None:
                    self.pool.give(pooled)

        held = 0 if group.keeps_full else full.numel() * full.element_size()
        marker = None
        # Only where a rank's backward gathers parameters (stage 3, unless every unit is gathered already)
        # can waiting for a peer's launch deadlock; elsewhere the oldest reduction is simply waited for
        # ([Note: bounded reductions]).
        # Only a group with more than MAX_INFLIGHT groups after it can be the oldest beyond the bound: the
        # last ones are waited for at the end of backward, markers or not (the same groups on every rank).
        guarded = bool(self.overlap_comm and held and self.params.backward_gathers())
        if guarded and group.index < len(self.groups) - MAX_INFLIGHT:
            marker = self.comm.agree_async([self._next], what=f"reduction marker of {names}")
        self._inflight.add(pending, then, held, marker=marker, guarded=guarded)
        self._track_bucket_bytes()
        for unit in group.units:
            self._hand_over(unit)
        if not self.overlap_comm:
            self.wait_all()
        self._inflight.retire_safely()

    # -- the accumulation boundary -------------------------------------------------------------------
    def local_has_grad(self) -> torch.Tensor:
        """This rank's flags, one per parameter of every unit in order: whether it got a gradient in any
        micro-step since the last zero. ``ShardedStep.checks`` combines them across ranks."""
        if not self.units:
            return torch.zeros(0, dtype=torch.bool)
        return torch.cat([u.has_grad for u in self.units])

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()
        self._buckets.clear()
        self.needs_reduction = False
        self._window_reduced = False
        self._replicated = False
