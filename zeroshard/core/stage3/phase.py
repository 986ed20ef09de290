"""Stage 3: the phases of the parameter gatherer, and the events that move it from one to the next.

[Note: gatherer phases]
What a module hook of :class:`~zeroshard.core.stage3.gatherer.ParameterGatherer` does depends on whether a
backward of the model is running, and whether that backward gathers:

* ``FORWARD``: no backward is running. A forward gathers its units, counts itself as their user, and its
  post-hook releases them (unless kept for reuse) and hooks its outputs for the backward.
* ``BACKWARD``: a backward is running. A forward now is a recomputation ([Note: recompute]): it only
  gathers. Units are released once their gradients are reduced, or earlier once spent ([Note: spent units]).
* ``GATHER_FREE_BACKWARD``: a backward that began with every sharded unit gathered, which is the same on
  every rank. It gathers nothing and spends nothing, and a gather asked for anyway is an error, so the
  reducer may wait for any reduction ([Note: bounded reductions]).

All transitions are in :func:`next_phase`.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Where the gatherer is in a step ([Note: gatherer phases])."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GATHER_FREE_BACKWARD = "gather-free backward"

    @property
    def in_backward(self) -> bool:
        """A backward is running: forwards are recomputations and units are released once reduced."""
        return self is not Phase.FORWARD


class Event(enum.Enum):
    """What moves the gatherer from one phase to another (the hook or method that reports it)."""

    FORWARD_STARTS = "the model's forward pre-hook, with no watched model forward running"
    OUTPUT_GRADIENT = "the gradient of a hooked module's output arrives (its before-backward hook)"
    BEGIN_BACKWARD = "ParameterGatherer.begin_backward: the engine starts a backward"
    END_BACKWARD = "ParameterGatherer.end_backward (end_forward of an evaluation forward)"


def next_phase(phase: Phase, event: Event, *, all_gathered: bool = False) -> Phase:
    """The phase after ``event`` in ``phase``; ``all_gathered`` (for ``BEGIN_BACKWARD``): every sharded unit
    is gathered.

    ===============  ===========================  ==========================================================
    event            from                         to
    ===============  ===========================  ==========================================================
    FORWARD_STARTS   any                          FORWARD: a backward this engine did not end (another
                                                  engine's loss through this model, a backward that raised)
                                                  is over
    OUTPUT_GRADIENT  FORWARD                      BACKWARD (a backward the engine did not begin:
                                                  ``loss.backward()``)
    OUTPUT_GRADIENT  BACKWARD, GATHER_FREE_BACK.  unchanged
    BEGIN_BACKWARD   any                          GATHER_FREE_BACKWARD if ``all_gathered``, else BACKWARD
    END_BACKWARD     any                          FORWARD
    ===============  ===========================  ==========================================================
    """
    if event is Event.OUTPUT_GRADIENT:
        return Phase.BACKWARD if phase is Phase.FORWARD else phase
    if event is Event.BEGIN_BACKWARD:
        return Phase.GATHER_FREE_BACKWARD if all_gathered else Phase.BACKWARD
    return Phase.FORWARD  # FORWARD_STARTS, END_BACKWARD
