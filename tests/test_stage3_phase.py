"""The stage-3 gatherer's phases ([Note: gatherer phases]) and the no-op parameter side: no processes."""

from __future__ import annotations

import pytest

from zeroshard.core.stage3.coupling import NoGatherer, ParameterSide
from zeroshard.core.stage3.phase import Event, Phase, next_phase


@pytest.mark.parametrize("phase", list(Phase))
def test_every_transition_of_the_table(phase: Phase) -> None:
    assert next_phase(phase, Event.FORWARD_STARTS) is Phase.FORWARD
    assert next_phase(phase, Event.END_BACKWARD) is Phase.FORWARD
    assert next_phase(phase, Event.BEGIN_BACKWARD, all_gathered=False) is Phase.BACKWARD
    assert next_phase(phase, Event.BEGIN_BACKWARD, all_gathered=True) is Phase.GATHER_FREE_BACKWARD
    # A backward reaching a module's output starts a backward from the forward and changes no backward.
    expected = Phase.BACKWARD if phase is Phase.FORWARD else phase
    assert next_phase(phase, Event.OUTPUT_GRADIENT) is expected
    assert phase.in_backward is (phase is not Phase.FORWARD)


def test_all_gathered_matters_only_when_a_backward_begins() -> None:
    for event in (Event.FORWARD_STARTS, Event.OUTPUT_GRADIENT, Event.END_BACKWARD):
        for phase in Phase:
            assert next_phase(phase, event, all_gathered=True) is next_phase(phase, event)


@pytest.mark.parametrize("gathers", [False, True])
def test_no_gatherer_releases_nothing_and_answers_the_plan(gathers: bool) -> None:
    side: ParameterSide = NoGatherer(gathers=gathers)
    side.on_reduced(object())  # type: ignore[arg-type]  # never looks at the unit
    assert side.backward_gathers() is gathers
