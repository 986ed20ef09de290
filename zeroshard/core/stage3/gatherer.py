"""Stage 3: gather each module's parameters just before it computes, release them after.

[Note: stage-3 lifecycle]
Between uses a stage-3 unit holds only this rank's master shard; its parameters are empty placeholders.

* Forward pre-hook of a module: gather the units of the parameters it owns directly (or, for a leaf module,
  of its whole subtree, and any registered external parameters), and prefetch the units that came next in
  the previous step's order, up to ``prefetch_bucket_size`` elements.
* Forward post-hook: release those units (unless another running module still uses them) and, when
  autograd will need them again, hook the module's outputs so that the units are gathered again just before
  the module's backward.
* A unit is released in backward as soon as its gradients are complete and copied into their gradient
  bucket (the reducer calls :meth:`ParameterGatherer.on_reduced`), or earlier once no backward node reads it
  ([Note: spent units]), and at the end of backward at the latest.

[Note: recompute]
With activation checkpointing a module's forward runs again inside backward (``torch.utils.checkpoint``,
either kind): autograd then keeps the recomputed activations, which are views of the gathered buffers, and
uses them for the module's backward right after. The post-hook must not release the units then: their
buffers would go back to the pool and the next gather would overwrite what backward is about to read. So
from the first backward hook of a step (or :meth:`begin_backward`) to :meth:`end_backward` (the backward
phases of [Note: gatherer phases]), a forward only gathers, and the units are released as in any backward,
once their gradients are reduced. Nor does it count as a user of its units: non-reentrant checkpointing
stops a recomputation as soon as it has rebuilt what backward saved, so the post-hook of the last module it
enters never runs.

The order in which units are needed is recorded every step; the next step prefetches from it, and a unit
that the prefetch would gather again at once (the last modules of the forward, first in the backward) is
kept instead of released (``prefetch.py``, [Note: prefetch schedule]). Every rank gathers in the same
order because every rank runs the same modules.

[Note: trim before the backward's end]
The last units of the backward (the first modules of the forward: a model's embeddings) are where
autograd's own transients peak: a tied embedding's gradient from the LM head waits there for the
embedding's, and adding the two allocates a third of that size. The buffer pool keeps idle buffers up to
the step's high-water mark ([Note: buffer reuse]), which on top of that peak is memory no request will use
before the next forward. So when a backward asks for the last unit of last step's order, the gatherer
first waits for the reductions in flight that every rank has launched ([Note: reducer and gatherer]),
then shrinks the pool's given-back buffers to what the forward gathered at most less what is still handed
out (those come back by the end of the backward) and less the units spent in this backward (their buffers
went back to the allocator, [Note: spent units]): enough bytes for the next forward, none beyond. The
backward's later requests (the last reduce-scatter outputs) and the next backward allocate the rest again.
With DeepSpeed's default ``stage3_max_reuse_distance`` the forward keeps most units gathered, so the pool
keeps most of its buffers.

Units that backward has finished reading are released before their gradients arrive (``spent_units.py``,
[Note: spent units]). Ranks that run different modules raise an error naming each rank's units instead of
pairing different collectives (``gather_check.py``, [Note: gather check]). Full buffers come from the
engine's :class:`~zeroshard.core.buffers.BufferPool` and go back to it on release. With hpZ the backward
gathers from secondary shards (``secondary.py``, [Note: hpZ secondary shards]).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.core.buffers import BufferPool
from zeroshard.core.flat_param import FlatUnit, unique_units
from zeroshard.core.inflight import InFlight
from zeroshard.core.reduction_groups import reentrant_reuse_error
from zeroshard.core.stage3.external_access import ExternalParameterSearch
from zeroshard.core.stage3.gather_check import GatherChecks
from zeroshard.core.stage3.hook_tools import eager, hook_outputs
from zeroshard.core.stage3.phase import Event, Phase, next_phase
from zeroshard.core.stage3.prefetch import PrefetchSchedule
from zeroshard.core.stage3.saved_views import SavedViews
from zeroshard.core.stage3.secondary import GatherSource
from zeroshard.core.stage3.spent_units import SpentUnits


@dataclasses.dataclass
class _StepRecord:
    """What the gatherer did in this step so far (from one ``end_step`` to the next)."""

    prefetched: set[int] = dataclasses.field(default_factory=set)  # gathered ahead of need, not yet needed
    forward_bytes: int = 0  # the most bytes gathered at once in this step's forward
    pool_trimmed: bool = False  # [Note: trim before the backward's end] done


class ParameterGatherer:
    """Owns the stage-3 module hooks and the gathered/released state of the stage-3 units.

    Its :class:`~zeroshard.core.stage3.phase.Phase` decides what the hooks do ([Note: gatherer phases]). As
    the reducer's :class:`~zeroshard.core.stage3.coupling.ParameterSide` it releases units once their
    gradients are reduced; ``reductions`` are the reducer's reductions in flight ([Note: reducer and
    gatherer]).

    Collective: the hooks gather with all-gathers (over the group ``source`` picks: [Note: hpZ secondary
    shards]), so every rank must run the same modules in the same order.
    """

    def __init__(
        self,
        module_units: Sequence[tuple[nn.Module, Sequence[FlatUnit]]],
        source: GatherSource,
        *,
        prefetch_elements: int,
        max_live_elements: int,
        max_reuse_distance: int,
        pool: BufferPool,
        reductions: InFlight,
    ) -> None:
        comm = source.gather  # the primary shards' group, every rank of it runs the hooks
        self.comm = comm
        self._source = source  # hpZ, int8: stage3/secondary.py, quantize.py
        self.pool = pool  # the units' own pool: holds are exempt from its high-water mark
        self._reductions = reductions
        self.schedule = PrefetchSchedule(  # see [Note: prefetch schedule]
            prefetch_elements=prefetch_elements,
            max_live_elements=max_live_elements,
            max_reuse_distance=max_reuse_distance,
        )
        self._units_of: dict[int, list[FlatUnit]] = {id(m): list(us) for m, us in module_units}
        self._modules: dict[int, nn.Module] = {id(m): m for m, _ in module_units}
        self._units_cache: list[FlatUnit] | None = None
        self._users: Counter[int] = Counter()  # running forwards that use each unit
        self._handles: list[RemovableHandle] = []
        self._phase = Phase.FORWARD  # changed by _move only: [Note: gatherer phases]
        # Units released in this backward because their gradients were reduced: ranks reach that point at
        # different moments, so such a unit is never gathered again in the same backward (same on all ranks).
        self._released_reduced: set[int] = set()
        self._step = _StepRecord()
        self._backwards = 0  # backwards ended: a hook gathers once per backward (retain_graph)
        self._running: list[int] = []  # keys of the hooked modules whose forward is running, innermost last
        self._search = ExternalParameterSearch(self._all_units, self._adopt)  # [Note: external parameters]
        self.peak_gathered_bytes = 0
        self._checks = GatherChecks(comm, self._describe)  # see [Note: gather check]
        self.saved_views = SavedViews(self.gather, comm.rank)  # see [Note: saved views]
        self._spent = SpentUnits(self.saved_views, self._modules_using)  # see [Note: spent units]
        # Whether any unit's shard is read from elsewhere (decided when the units were built, before this).
        self._reads_ahead = any(u.store.prefetches for _, us in module_units for u in us)

    @property
    def phase(self) -> Phase:
        """Where the gatherer is in the step ([Note: gatherer phases])."""
        return self._phase

    def _move(self, event: Event) -> None:
        """Take ``event``'s transition (the table: :func:`~zeroshard.core.stage3.phase.next_phase`)."""
        sharded = (u for u in self._all_units() if u.plan.shard_parameters)
        all_gathered = event is Event.BEGIN_BACKWARD and all(u.gathered for u in sharded)
        self._phase = next_phase(self._phase, event, all_gathered=all_gathered)

    @property
    def discovering(self) -> bool:
        """Whether the next forward watches torch calls for external parameters. Such a forward runs eagerly
        under ``torch.compile`` (see ``ZeroshardEngine._forward``): compiled, the watching would be traced
        into every graph, which then changes when the watching stops."""
        return self._search.active

    # -- hooks ---------------------------------------------------------------------------------------
    def register(self, root: nn.Module) -> None:
        """Install the module hooks, and on ``root`` the saved-tensor hooks of [Note: saved views] for the
        duration of every forward (also when the model is called directly, not through the engine)."""
        for key, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(eager(self._make_pre(key))))
            self._handles.append(module.register_forward_hook(eager(self._make_post(key))))
        if id(root) not in self._modules:  # adopted units need a running module to belong to
            self._units_of[id(root)] = []
            self._modules[id(root)] = root
            self._handles.append(root.register_forward_pre_hook(eager(self._make_pre(id(root)))))
            self._handles.append(root.register_forward_hook(eager(self._make_post(id(root)))))
        self._handles.append(root.register_forward_pre_hook(eager(self._enter_forward), prepend=True))
        self._handles.append(root.register_forward_hook(eager(self._exit_forward), always_call=True))

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        if not self._search.watching:
            self._running.clear()  # a forward that raised left its modules on the stack
            self._move(Event.FORWARD_STARTS)
        self.saved_views.enter()
        self._search.enter()

    def _exit_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._search.exit()
        self.saved_views.exit()

    def _adopt(self, unit: FlatUnit) -> None:
        """The running module reads a parameter of ``unit``, which it does not own: from now on ``unit`` is
        gathered with the module's own ([Note: external parameters]). Collective: all ranks."""
        key = self._running[-1]
        if unit not in self._units_of[key]:
            self._units_of[key].append(unit)
            self._spent.users_changed()
        self.gather([unit])
        self._users[unit.index] += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_pre(self, key: int) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            units = self._units_of[key]
            if self._phase.in_backward:  # a recomputation: never spent in this backward
                self._spent.recomputed.update(u.index for u in units)
                reduced = [u for u in units if u.index in self._released_reduced]
                if reduced:  # [Note: repeated gradients]
                    what = f"{type(module).__name__} ran again"
                    raise reentrant_reuse_error(self.comm.rank, reduced[0], what)
            self.gather(units)
            if self._phase.in_backward:
                return  # a recomputation: nothing to count, its post-hook may never run ([Note: recompute])
            self._running.append(key)
            for unit in units:
                self._users[unit.index] += 1

        return pre

    def _make_post(self, key: int) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self._phase.in_backward:
                return
            if self._running and self._running[-1] == key:
                self._running.pop()
            units = self._units_of[key]
            for unit in units:
                self._users[unit.index] -= 1
                if self._users[unit.index] == 0 and not self.schedule.reused_soon(unit):
                    unit.release()
            if torch.is_grad_enabled():
                fired = [-1]  # the backward that gathered for this output, counted by end_backward

                def before_backward(grad: torch.Tensor) -> None:
                    self._move(Event.OUTPUT_GRADIENT)
                    # Once per backward: a second backward through a retained graph gathers again.
                    if fired[0] != self._backwards:
                        fired[0] = self._backwards
                        self.gather([u for u in units if not self._spend(u)])

                hook_outputs(output, before_backward)

        return post

    # -- gathering -----------------------------------------------------------------------------------
    def gather(self, units: Iterable[FlatUnit]) -> None:
        """Make ``units`` gathered, prefetching what came next last step. Collective: all ranks."""
        units = list(units)
        step = self._step
        if self._phase.in_backward:
            self._release_spent()
        missing = [u for u in units if not u.gathered and u.index not in self._released_reduced]
        # The order records each unit where it is needed, whether a prefetch already brought it or not.
        needed = [u for u in units if u in missing or u.index in step.prefetched]
        step.prefetched.difference_update(u.index for u in needed)
        self.schedule.record(needed)
        # One check for the units needed now and the ones prefetched with them.
        live = sum(u.layout.padded for u in self._all_units() if u.gathered or u in missing)
        ahead = self.schedule.candidates(missing, live, self._released_reduced | self._spent.spent)
        step.prefetched.update(u.index for u in ahead)
        self._start_many(missing + ahead)
        if self._reads_ahead:
            self.schedule.read_ahead()
        self._checks.verify(u.index for u in units)
        for unit in units:
            unit.finish_gather()
            self.saved_views.note(unit)
        self._source.keep(units, self._phase)
        live = sum(u.full.numel() * u.full.element_size() for u in self._all_units() if u.gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        if not self._phase.in_backward:
            step.forward_bytes = max(step.forward_bytes, live)
        elif not step.pool_trimmed and self.schedule.exhausted:
            self._trim_for_next_forward()

    def _trim_for_next_forward(self) -> None:
        """See [Note: trim before the backward's end]. The spent units' buffers were let go, and their room
        is not kept idle either ([Note: spent units])."""
        self._step.pool_trimmed = True
        self._reductions.retire_launched()
        spent = sum(u.layout.padded * u.policy.compute.itemsize for u in self._spent_units())
        self.pool.shrink(self._step.forward_bytes - self.pool.out_bytes - spent)

    # -- spent units: [Note: spent units] --------------------------------------------------------------
    def _spent_units(self) -> Iterator[FlatUnit]:
        return (u for u in self._all_units() if u.index in self._spent.spent)

    def _modules_using(self, unit: FlatUnit) -> Iterator[nn.Module]:
        return (self._modules[key] for key, units in self._units_of.items() if unit in units)

    def _spend(self, unit: FlatUnit) -> bool:
        """Release ``unit`` if it is spent (and say whether it is); not while a forward or a hold uses it,
        nor once its gradients were reduced."""
        if self._phase is Phase.GATHER_FREE_BACKWARD:
            return False  # a spent unit may be recomputed, which would gather it again
        busy = self._users[unit.index] > 0 or unit.index in self._released_reduced
        return self._spent.spend(unit, busy=busy)

    def _release_spent(self) -> None:
        """Release the gathered units that are spent; those of them a prefetch brought are not (needed
        next, their views may come with a recomputation)."""
        for unit in self._spent.candidates(self._all_units()):
            if unit.gathered and unit.index not in self._step.prefetched:
                self._spend(unit)

    def _start_many(self, units: list[FlatUnit], exact: bool = False) -> None:
        """Launch the all-gathers of ``units`` with their gather check ([Note: gather check])."""
        if not units:
            return
        if self._phase is Phase.GATHER_FREE_BACKWARD:
            raise RuntimeError(
                f"rank {self.comm.rank}: {self._describe(units[0].index)} is gathered again in a backward "
                "that began with every unit gathered and so does not wait for its peers' gathers; its "
                "gradients were already reduced (a GatheredParameters inside backward?)"
            )
        self._checks.launch([u.index for u in units])
        for unit in units:
            self._source.start(unit, exact=exact)

    def _describe(self, index: int) -> str:
        for unit in self._all_units():
            if unit.index == index:
                return f"unit {index} ({', '.join(unit.names)})"
        return f"unit {index}"

    @contextlib.contextmanager
    def hold_all(self) -> Iterator[None]:
        """Keep every unit gathered inside the block (one gather each), release on exit. Collective."""
        with self.hold(self._all_units()):
            yield

    @contextlib.contextmanager
    def hold(self, units: Iterable[FlatUnit], write_back: bool = False) -> Iterator[None]:
        """Keep ``units`` gathered inside the block; with ``write_back`` copy their full parameters back into
        the master shards on exit (after an in-place modification). Collective: all ranks, same units."""
        units = sorted(unique_units(units), key=lambda u: u.index)
        self._source.check_exact(units, write_back)
        with self.pool.exempt():  # a one-off demand: see [Note: buffer reuse]
            self._start_many([u for u in units if not u.gathered], exact=True)
        self._checks.verify(u.index for u in units)
        for unit in units:
            unit.finish_gather()
            self._users[unit.index] += 1
        try:
            yield
        finally:
            for unit in units:
                if write_back:
                    unit.full_to_master()
                self._users[unit.index] -= 1
                # In backward, a unit whose gradients are still to come stays gathered until they are
                # reduced (on_reduced) or backward ends: autograd lays each gradient out like its
                # parameter's data, so that data must still be full when the gradient lands (a custom
                # Function that gathers its saved weight in backward returns that weight's gradient
                # after leaving the block).
                pending = self._phase.in_backward and unit.index not in self._released_reduced
                if self._users[unit.index] == 0 and not pending:
                    unit.release()

    def begin_backward(self) -> None:
        """Backward starts: forwards that run from now to :meth:`end_backward` are recomputations, and it is
        gather-free if every unit is gathered ([Note: gatherer phases])."""
        self._move(Event.BEGIN_BACKWARD)

    # -- the reducer's ParameterSide: [Note: reducer and gatherer] -----------------------------------
    def on_reduced(self, unit: FlatUnit) -> None:
        """The reducer took ``unit``'s gradients: its full parameters are not needed any more."""
        if unit.plan.shard_parameters and self._users[unit.index] == 0:
            self._released_reduced.add(unit.index)
            unit.release()

    def backward_gathers(self) -> bool:
        """Whether this backward may still gather: all but a gather-free one ([Note: bounded reductions])."""
        return self._phase is not Phase.GATHER_FREE_BACKWARD

    def end_backward(self) -> None:
        """Release everything still gathered and start the next step's prefetch schedule."""
        self._checks.verify()
        for unit in self._all_units():
            if self._users[unit.index] == 0:
                unit.release()
        self._released_reduced.clear()
        self._spent.end_backward()
        self._move(Event.END_BACKWARD)
        self._backwards += 1
        self.end_step()

    def end_forward(self, backward_follows: bool) -> None:
        """The model's forward returned; without a backward to come (evaluation) release everything now."""
        if not backward_follows:
            self.end_backward()

    def end_step(self) -> None:
        self._step = _StepRecord()
        self.schedule.end_step()

    def _all_units(self) -> list[FlatUnit]:
        """Every unit any hooked module gathers (cached: called on every gather)."""
        if self._units_cache is None:
            self._units_cache = unique_units(u for units in self._units_of.values() for u in units)
        return self._units_cache
