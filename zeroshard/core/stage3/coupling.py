"""What gradient reduction and stage-3 gathering need from each other, passed at construction.

[Note: reducer and gatherer]
Two things cross between the :class:`~zeroshard.core.grad_sync.GradientReducer` and the stage-3
:class:`~zeroshard.core.stage3.gatherer.ParameterGatherer`:

* The reducer tells the parameter side when a unit's gradients are all in their bucket or handed to their
  reduction (stage 3 releases the unit's full parameters then: [Note: stage-3 lifecycle]), and asks it
  whether this backward may still gather parameters (if not, a reduction may be waited for before every
  rank is known to have launched it: [Note: bounded reductions]). That is :class:`ParameterSide`, which the
  reducer takes at construction: the gatherer at stage 3, :class:`NoGatherer` where no hook gathers.
* Before it trims the buffer pool, the gatherer waits for the reductions that every rank has launched
  ([Note: trim before the backward's end]). Those are an :class:`~zeroshard.core.inflight.InFlight` that
  both take at construction: the reducer launches into it, the gatherer retires from it.

So the gatherer is built first and the reducer after it (``runtime/build.py``); neither holds the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from zeroshard.core.flat_param import FlatUnit


class ParameterSide(Protocol):
    """What the gradient reducer needs from whoever gathers the parameters ([Note: reducer and gatherer])."""

    def on_reduced(self, unit: FlatUnit) -> None:
        """``unit``'s gradients are all in their bucket or handed to their reduction: its full parameters
        are not needed any more. Called once per unit and backward. Local."""

    def backward_gathers(self) -> bool:
        """Whether this backward may still gather parameters, so that a peer may be waiting for this rank's
        gather ([Note: bounded reductions]). The same on every rank."""


class NoGatherer:
    """The parameter side where no hook gathers parameters (stages 0-2, and stage 3 when every unit is kept
    whole on every rank): nothing to release.

    ``gathers`` answers :meth:`backward_gathers`: the stage plan's ``shard_parameters``, so a stage-3
    reducer still sends the markers of [Note: bounded reductions] when no unit ended up sharded.
    """

    def __init__(self, *, gathers: bool) -> None:
        self._gathers = gathers

    def on_reduced(self, unit: FlatUnit) -> None:
        """Nothing: the parameters stay as they are."""

    def backward_gathers(self) -> bool:
        return self._gathers
