"""Stage 3: units that backward has finished reading before their gradients arrive.

[Note: spent units]
A unit stays gathered in backward until its gradients are reduced, but autograd may be done reading it long
before: a tied embedding is read by the LM head's backward, the first of the step, and its gradient is
complete only after the embedding's backward, the last, where autograd's own transients peak. Autograd reads
a gathered buffer in backward only through the tensors it saved in forward, which [Note: saved views] packs
as references and tracks: once every one of them is gone (autograd frees a node's saved tensors when the
node has run), no backward node reads the unit any more. Such a unit is *spent*: at the next gather of the
backward it is released (``FlatUnit.release_before_gradients``: each parameter a NaN stand-in of its shape,
which is all ``AccumulateGrad`` needs of it), its buffer goes back to the allocator, and the backward hooks
do not gather it again, which also spares the backward gather of an embedding (whose backward needs the
token ids, not the table). This holds only where nothing reads the parameter objects themselves in
backward: units gathered by ``PLAIN_LAYERS`` modules alone (``nn.Linear``, ``nn.Embedding``, ...: built-in
layers whose forward is a single torch function with autograd's own backward). A unit a recomputation
gathered (activation checkpointing: its views are packed only as the recomputed forward runs), a unit
prefetched and not yet needed, and a unit held by ``GatheredParameters`` are never spent; whether a unit is
spent follows from the graph, which is the same on every rank, so the gathers stay collective-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.stage3.saved_views import SavedViews

# Built-in layers whose backward reads their parameters only through the tensors autograd saved in forward:
# a unit gathered by these alone can be released once those tensors are gone.
PLAIN_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
)


class SpentUnits:
    """The spent units of one backward ([Note: spent units]). Local: it launches nothing.

    ``modules_using(unit)`` gives the modules that gather ``unit``.
    """

    def __init__(self, saved_views: SavedViews, modules_using: Callable[[FlatUnit], Iterable[nn.Module]]):
        self._saved_views = saved_views
        self._modules_using = modules_using
        self.spent: set[int] = set()  # released in this backward before their gradients arrived
        self.recomputed: set[int] = set()  # gathered by a recomputation in this backward: never spent
        self._plain: dict[int, bool] = {}  # whether only PLAIN_LAYERS gather the unit
        self._candidates: list[FlatUnit] | None = None

    def users_changed(self) -> None:
        """A module now gathers a unit it did not before (an adopted external parameter)."""
        self._plain.clear()
        self._candidates = None

    def candidates(self, units: list[FlatUnit]) -> list[FlatUnit]:
        """Those of ``units`` (every unit, the same list each call) that can be spent at all: sharded and
        gathered by PLAIN_LAYERS alone. Cached: the backward checks them at every gather."""
        if self._candidates is None:
            self._candidates = [u for u in units if u.plan.shard_parameters and self._only_plain_layers(u)]
        return self._candidates

    def spend(self, unit: FlatUnit, *, busy: bool) -> bool:
        """If ``unit`` is spent, release it (gathered or not: its parameters become the stand-ins that its
        gradients are laid out against) and return True. ``busy``: something still uses it."""
        if unit.index in self.spent:
            return True
        if busy or not unit.plan.shard_parameters or unit.index in self.recomputed:
            return False
        if not self._only_plain_layers(unit) or self._saved_views.held(unit):
            return False
        unit.release_before_gradients()
        self.spent.add(unit.index)
        return True

    def _only_plain_layers(self, unit: FlatUnit) -> bool:
        plain = self._plain.get(unit.index)
        if plain is None:
            plain = all(type(module) in PLAIN_LAYERS for module in self._modules_using(unit))
            self._plain[unit.index] = plain
        return plain

    def end_backward(self) -> None:
        self.spent.clear()
        self.recomputed.clear()
