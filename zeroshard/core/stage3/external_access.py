"""Stage 3: parameters used outside the module that owns them are found and gathered on first use.

[Note: external parameters]
The stage-3 hooks gather a module's own parameters around its forward. Some code reads a parameter of
another module instead: ``nn.MultiheadAttention`` passes ``out_proj.weight`` to a functional call, a language
model head computes ``F.linear(h, embedding.weight)``, a parent reads ``self.child.weight``. Between uses such
a parameter is an empty placeholder, so the read would fail (or worse, see a stale shape).

While a stage-3 model's forward runs, :class:`ParameterAccess` (a ``TorchFunctionMode``) looks at the
arguments of every torch call. When it meets a managed parameter whose unit is not gathered, it asks the
gatherer to *adopt* the unit for the innermost running module: the unit is gathered now (collective: every
rank runs the same code, so every rank meets the same parameter at the same point, and the gather check
verifies it), counted as used by that module, released by its post-hook and gathered again before its
backward, exactly like its own units; from the next step on the module's pre-hook gathers it up front.

Looking at every torch call costs about a tenth of a stage-3 step on the demo GPT, so the gatherer watches
only until one whole forward with gradients enabled, or two evaluation forwards in a row, have needed no
adoption: normally the first (a model with no external parameter) or the second training forward. A
parameter that a data-dependent branch reads for the first time after that is not found: declare it with
``register_external_parameter``; otherwise torch's error carries a note saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.core.flat_param import FlatUnit


class ParameterAccess(TorchFunctionMode):
    """Calls ``adopt(unit)`` before any torch call that reads a parameter of a released unit.

    ``unit_of`` maps ``id(param)`` of every stage-3 managed parameter to its unit.
    """

    def __init__(self, unit_of: Mapping[int, FlatUnit], adopt: Callable[[FlatUnit], None]) -> None:
        super().__init__()
        self._unit_of = unit_of
        self._adopt = adopt

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        self._check(args)
        if kwargs:
            self._check(kwargs.values())
        return func(*args, **kwargs)

    def _check(self, values: Iterable[Any]) -> None:
        for value in values:
            if isinstance(value, nn.Parameter):
                unit = self._unit_of.get(id(value))
                if unit is not None and not unit.gathered:
                    self._adopt(unit)
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], nn.Parameter):
                self._check(value)  # e.g. torch.cat([w1, w2])


class ExternalParameterSearch:
    """Whether model forwards watch torch calls for external parameters, and the watch of each running one.
    Local: ``adopt`` gathers.

    ``units()`` gives every stage-3 unit (the same list each call); ``adopt(unit)`` gathers ``unit`` for the
    innermost running module. Watching stops after one whole forward with gradients enabled, or two
    evaluation forwards in a row, that adopted nothing.
    """

    def __init__(self, units: Callable[[], list[FlatUnit]], adopt: Callable[[FlatUnit], None]) -> None:
        self._units = units
        self._unit_of: dict[int, FlatUnit] | None = None  # id(param) -> unit, built at the first watch
        self._adopt = adopt
        self.active = True  # the next model forward watches
        self._watches: list[contextlib.ExitStack] = []  # one per running model forward, innermost last
        self._adopted = False  # the current watch adopted a unit
        self._quiet_forwards = 0  # watched forwards in a row that adopted nothing

    @property
    def watching(self) -> bool:
        """Whether a model forward is running under a watch."""
        return bool(self._watches)

    def enter(self) -> None:
        """A model forward starts: watch it while the search is active."""
        if self.active:
            if self._unit_of is None:
                self._unit_of = {id(p): u for u in self._units() for p in u.params}
            watch = contextlib.ExitStack()
            watch.enter_context(ParameterAccess(self._unit_of, self._adopt_unit))
            self._watches.append(watch)
            self._adopted = False

    def exit(self) -> None:
        """A model forward ends: stop its watch, and the search once forwards stop adopting."""
        if self._watches:
            self._watches.pop().close()
            if not self._adopted and not self._watches:
                # A whole training forward needed nothing more (or two evaluation forwards did: an engine
                # that only evaluates, e.g. a frozen teacher, stops watching too).
                self._quiet_forwards += 1
                self.active = torch.is_grad_enabled() is False and self._quiet_forwards < 2

    def _adopt_unit(self, unit: FlatUnit) -> None:
        self._adopt(unit)
        self._adopted = True
        self._quiet_forwards = 0
