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
from the first backward hook of a step (or :meth:`begin_backward`) to :meth:`end_backward`, a forward only
gathers, and the units are released as in any backward, once their gradients are reduced. Nor does it count
as a user of its units: non-reentrant checkpointing stops a recomputation as soon as it has rebuilt what
backward saved, so the post-hook of the last module it enters never runs.

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
first lets ``on_last_gather`` (the reducer) wait for the reductions in flight that every rank has launched,
then shrinks the pool's given-back buffers to what the forward gathered at most less what is still handed
out (those come back by the end of the backward) and less the units spent in this backward (their buffers
went back to the allocator, [Note: spent units]): enough bytes for the next forward, none beyond. The
backward's later requests (the last reduce-scatter outputs) and the next backward allocate the rest again.
With DeepSpeed's default ``stage3_max_reuse_distance`` the forward keeps most units gathered, so the pool
keeps most of its buffers.

Units that backward has finished reading are released before their gradients arrive (``spent_units.py``,
[Note: spent units]).

Ranks that run different modules raise an error naming each rank's units instead of pairing different
collectives (``gather_check.py``, [Note: gather check]). Full buffers come from the engine's
:class:`~zeroshard.core.buffers.BufferPool` and go back to it on release.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit, unique_units
from zeroshard.core.grad_sync import reentrant_reuse_error
from zeroshard.core.stage3.external_access import ParameterAccess
from zeroshard.core.stage3.gather_check import GatherChecks
from zeroshard.core.stage3.prefetch import PrefetchSchedule
from zeroshard.core.stage3.saved_views import SavedViews
from zeroshard.core.stage3.spent_units import SpentUnits


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (a module's outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


class ParameterGatherer:
    """Owns the stage-3 module hooks and the gathered/released state of the stage-3 units.

    Collective: the hooks gather with all-gathers, so every rank must run the same modules in the same order.
    """

    def __init__(
        self,
        module_units: Sequence[tuple[nn.Module, Sequence[FlatUnit]]],
        comm: Comm,
        *,
        prefetch_elements: int,
        max_live_elements: int,
        max_reuse_distance: int,
        pool: BufferPool,
    ) -> None:
        self.comm = comm
        self.pool = pool  # the units' own pool: holds are exempt from its high-water mark
        self.schedule = PrefetchSchedule(  # see [Note: prefetch schedule]
            prefetch_elements=prefetch_elements,
            max_live_elements=max_live_elements,
            max_reuse_distance=max_reuse_distance,
        )
        self._units_of: dict[int, list[FlatUnit]] = {}
        self._modules: dict[int, nn.Module] = {}
        self._units_cache: list[FlatUnit] | None = None
        for module, units in module_units:
            self._units_of[id(module)] = list(units)
            self._modules[id(module)] = module
        self._users: Counter[int] = Counter()  # running forwards that use each unit
        self._handles: list[RemovableHandle] = []
        # Units released in this backward because their gradients are complete. Ranks may reach that
        # point at different moments (it follows local gradient readiness), so such a unit is never
        # gathered again in the same backward: the decision to gather stays the same on every rank.
        self._done: set[int] = set()
        self._prefetched: set[int] = set()  # units gathered ahead of need, not yet needed
        # Between the first backward hook of a step and end_backward: a module forward that runs now is a
        # recomputation (activation checkpointing), whose units backward needs next; see [Note: recompute].
        self._in_backward = False
        # This engine's backward started with every unit gathered, so it gathers nothing ([Note: bounded
        # reductions]): the reducer may wait for any reduction, and nothing may be gathered (or spent).
        self.gather_free = False
        self._backwards = 0  # backwards ended: a hook gathers once per backward (retain_graph)
        self._running: list[int] = []  # keys of the hooked modules whose forward is running, innermost last
        self._access: list[contextlib.ExitStack] = []  # one per running model forward, each a ParameterAccess
        self._param_units: dict[int, FlatUnit] | None = None
        self._discovering = True  # watch torch calls for external parameters ([Note: external parameters])
        self._adopted_now = False
        self._quiet_forwards = 0  # forwards in a row that adopted nothing
        self.peak_gathered_bytes = 0
        self._forward_bytes = 0  # the most bytes gathered at once in this step's forward
        self._trimmed = False  # the pool was shrunk in this backward: [Note: trim before the backward's end]
        # Called before that shrink (the reducer waits for the reductions every rank has launched).
        self.on_last_gather: Callable[[], None] | None = None
        self._checks = GatherChecks(comm, self._describe)  # see [Note: gather check]
        self.saved_views = SavedViews(self.gather, comm.rank)  # see [Note: saved views]
        self._spent = SpentUnits(self.saved_views, self._modules_using)  # see [Note: spent units]
        # Whether any unit's shard is read from elsewhere (decided when the units were built, before this).
        self._reads_ahead = any(u.store.prefetches for _, us in module_units for u in us)

    @property
    def discovering(self) -> bool:
        """Whether the next forward watches torch calls for external parameters. Such a forward runs eagerly
        under ``torch.compile`` (see ``ZeroshardEngine._forward``): compiled, the watching would be traced
        into every graph, which then changes when the watching stops."""
        return self._discovering

    # -- hooks ---------------------------------------------------------------------------------------
    def register(self, root: nn.Module) -> None:
        """Install the module hooks, and on ``root`` the saved-tensor hooks of [Note: saved views] for the
        duration of every forward (also when the model is called directly, not through the engine)."""
        for key, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(_eager(self._make_pre(key))))
            self._handles.append(module.register_forward_hook(_eager(self._make_post(key))))
        if id(root) not in self._modules:  # adopted units need a running module to belong to
            self._units_of[id(root)] = []
            self._modules[id(root)] = root
            self._handles.append(root.register_forward_pre_hook(_eager(self._make_pre(id(root)))))
            self._handles.append(root.register_forward_hook(_eager(self._make_post(id(root)))))
        self._handles.append(root.register_forward_pre_hook(_eager(self._enter_forward), prepend=True))
        self._handles.append(root.register_forward_hook(_eager(self._exit_forward), always_call=True))

    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        if not self._access:
            self._running.clear()  # a forward that raised left its modules on the stack
            # A new forward of the model: any backward that set the flag without this engine's end_backward
            # (another engine's loss backpropagated through this model, or a backward that raised) is over.
            self._in_backward = self.gather_free = False
        self.saved_views.enter()
        if self._discovering:  # [Note: external parameters]
            access = contextlib.ExitStack()
            access.enter_context(ParameterAccess(self._unit_of_param(), self._adopt))
            self._access.append(access)
            self._adopted_now = False

    def _exit_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._access:
            self._access.pop().close()
            if not self._adopted_now and not self._access:
                # A whole training forward needed nothing more (or two evaluation forwards did: an engine
                # that only evaluates, e.g. a frozen teacher, stops watching too).
                self._quiet_forwards += 1
                self._discovering = torch.is_grad_enabled() is False and self._quiet_forwards < 2
        self.saved_views.exit()

    def _unit_of_param(self) -> dict[int, FlatUnit]:
        if self._param_units is None:
            self._param_units = {id(p): u for u in self._all_units() for p in u.params}
        return self._param_units

    def _adopt(self, unit: FlatUnit) -> None:
        """The running module reads a parameter of ``unit``, which it does not own: from now on ``unit`` is
        gathered with the module's own ([Note: external parameters]). Collective: all ranks."""
        key = self._running[-1]
        if unit not in self._units_of[key]:
            self._units_of[key].append(unit)
            self._spent.users_changed()
        self.gather([unit])
        self._users[unit.index] += 1
        self._adopted_now = True
        self._quiet_forwards = 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _make_pre(self, key: int) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            units = self._units_of[key]
            if self._in_backward:  # a recomputation: never spent in this backward
                self._spent.recomputed.update(u.index for u in units)
                reduced = [u for u in units if u.index in self._done]
                if reduced:  # [Note: repeated gradients]
                    what = f"{type(module).__name__} ran again"
                    raise reentrant_reuse_error(self.comm.rank, reduced[0], what)
            self.gather(units)
            if self._in_backward:
                return  # a recomputation: nothing to count, its post-hook may never run ([Note: recompute])
            self._running.append(key)
            for unit in units:
                self._users[unit.index] += 1

        return pre

    def _make_post(self, key: int) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if self._in_backward:
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
                    self._in_backward = True
                    # Once per backward: a second backward through a retained graph gathers again.
                    if fired[0] != self._backwards:
                        fired[0] = self._backwards
                        self.gather([u for u in units if not self._spend(u)])

                for tensor in iter_tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(before_backward)

        return post

    # -- gathering -----------------------------------------------------------------------------------
    def gather(self, units: Iterable[FlatUnit]) -> None:
        """Make ``units`` gathered, prefetching what came next last step. Collective: all ranks."""
        units = list(units)
        if self._in_backward:
            self._release_spent()
        missing = [u for u in units if not u.gathered and u.index not in self._done]
        # The order records each unit where it is needed, whether a prefetch already brought it or not.
        needed = [u for u in units if u in missing or u.index in self._prefetched]
        self._prefetched.difference_update(u.index for u in needed)
        self.schedule.record(needed)
        # One check for the units needed now and the ones prefetched with them.
        live = sum(u.layout.padded for u in self._all_units() if u.gathered or u in missing)
        ahead = self.schedule.candidates(missing, live, self._done | self._spent.spent)
        self._prefetched.update(u.index for u in ahead)
        self._start_many(missing + ahead)
        if self._reads_ahead:
            self.schedule.read_ahead()
        self._checks.verify(u.index for u in units)
        for unit in units:
            unit.finish_gather()
            self.saved_views.note(unit)
        live = sum(u.full.numel() * u.full.element_size() for u in self._all_units() if u.gathered)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, live)
        if not self._in_backward:
            self._forward_bytes = max(self._forward_bytes, live)
        elif not self._trimmed and self.schedule.exhausted:
            self._trim_for_next_forward()

    def _trim_for_next_forward(self) -> None:
        """See [Note: trim before the backward's end]. The spent units' buffers were let go, and their room
        is not kept idle either ([Note: spent units])."""
        self._trimmed = True
        if self.on_last_gather is not None:
            self.on_last_gather()
        spent = sum(self._full_bytes(u) for u in self._all_units() if u.index in self._spent.spent)
        self.pool.shrink(self._forward_bytes - self.pool.out_bytes - spent)

    @staticmethod
    def _full_bytes(unit: FlatUnit) -> int:
        return unit.layout.padded * unit.policy.compute.itemsize

    # -- spent units: [Note: spent units] --------------------------------------------------------------
    def _modules_using(self, unit: FlatUnit) -> Iterator[nn.Module]:
        return (self._modules[key] for key, units in self._units_of.items() if unit in units)

    def _spend(self, unit: FlatUnit) -> bool:
        """Release ``unit`` if it is spent (and say whether it is); not while a forward or a hold uses it,
        nor once its gradients were reduced."""
        if self.gather_free:
            return False  # a spent unit may be recomputed, which would gather it again
        return self._spent.spend(unit, busy=self._users[unit.index] > 0 or unit.index in self._done)

    def _release_spent(self) -> None:
        """Release the gathered units that are spent; those of them a prefetch brought are not (needed
        next, their views may come with a recomputation)."""
        for unit in self._spent.candidates(self._all_units()):
            if unit.gathered and unit.index not in self._prefetched:
                self._spend(unit)

    def _start_many(self, units: list[FlatUnit]) -> None:
        """Launch the all-gathers of ``units`` with their gather check ([Note: gather check])."""
        if not units:
            return
        if self.gather_free:
            raise RuntimeError(
                f"rank {self.comm.rank}: {self._describe(units[0].index)} is gathered again in a backward "
                "that began with every unit gathered and so does not wait for its peers' gathers; its "
                "gradients were already reduced (a GatheredParameters inside backward?)"
            )
        self._checks.launch([u.index for u in units])
        for unit in units:
            unit.start_gather(self.comm)

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
        with self.pool.exempt():  # a one-off demand: see [Note: buffer reuse]
            self._start_many([u for u in units if not u.gathered])
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
                pending = self._in_backward and unit.index not in self._done
                if self._users[unit.index] == 0 and not pending:
                    unit.release()

    def begin_backward(self) -> None:
        """Backward starts: forwards that run from now to :meth:`end_backward` are recomputations. Whether
        it is gather-free is the same on every rank: which units are gathered follows last step's order."""
        self._in_backward = True
        self.gather_free = all(u.gathered for u in self._all_units() if u.plan.shard_parameters)

    def on_reduced(self, unit: FlatUnit) -> None:
        """The reducer took ``unit``'s gradients: its full parameters are not needed any more."""
        if unit.plan.shard_parameters and self._users[unit.index] == 0:
            self._done.add(unit.index)
            unit.release()

    def end_backward(self) -> None:
        """Release everything still gathered and start the next step's prefetch schedule."""
        self._checks.verify()
        for unit in self._all_units():
            if self._users[unit.index] == 0:
                unit.release()
        self._done.clear()
        self._spent.end_backward()
        self._in_backward = False
        self.gather_free = False
        self._backwards += 1
        self.end_step()

    def end_forward(self, backward_follows: bool) -> None:
        """The model's forward returned; without a backward to come (evaluation) release everything now."""
        if not backward_follows:
            self.end_backward()

    def end_step(self) -> None:
        self._prefetched.clear()
        self._forward_bytes = 0
        self._trimmed = False
        self.schedule.end_step()

    def _all_units(self) -> list[FlatUnit]:
        """Every unit any hooked module gathers (cached: called on every gather)."""
        if self._units_cache is None:
            self._units_cache = unique_units(u for units in self._units_of.values() for u in units)
        return self._units_cache


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly under ``torch.compile``: the compiler stops at the hook (one graph break each),
    runs it as Python (collectives, ``param.data`` swaps) and compiles the module's own code around it.
    Traced instead, the gathers would break the graph at every collective and every buffer check."""
    disabled: Callable[..., Any] = torch.compiler.disable(hook, recursive=True)
    return disabled
