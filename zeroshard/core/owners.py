"""Finding, from a parameter alone, the object that holds zeroshard's state for it.

[Note: parameter owners]
DeepSpeed's API hands user code nothing but parameters: ``GatheredParameters(params)``,
``safe_get_full_fp32_param(param)``, ``from_pretrained`` filling a model built under ``zero.Init``. What those
calls need lives with its owner, never on the parameter: the engine that trains a parameter keeps a
``ParameterMap`` from each of its parameters to its unit, and each ``zero.Init`` context keeps one from each
parameter it partitioned to this rank's shard. An ``OwnerRegistry`` only lists the maps that exist now and
asks them in turn, newest first; it stores no entry of its own. So two engines in one process share no
state, and an entry lives no longer than its parameter and its owner's map.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Generic, TypeVar

from torch import nn

V = TypeVar("V")


class ParameterMap(Generic[V]):
    """Values keyed by parameter identity (a tensor compares by value, so it cannot be a dictionary key).

    Invariant: an entry is dropped as soon as its parameter is garbage collected, so a new parameter that
    reuses a dead one's ``id`` never finds the dead one's value.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[nn.Parameter], V]] = {}

    def __setitem__(self, param: nn.Parameter, value: V) -> None:
        key, entries = id(param), self._entries

        def forget(ref: weakref.ref[nn.Parameter]) -> None:
            if key in entries and entries[key][0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(param, forget), value)

    def get(self, param: nn.Parameter) -> V | None:
        entry = self._entries.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def pop(self, param: nn.Parameter) -> V | None:
        value = self.get(param)
        if value is not None:
            del self._entries[id(param)]
        return value

    def __contains__(self, param: nn.Parameter) -> bool:
        return self.get(param) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> Iterator[V]:
        return (value for _, value in self._entries.values())


class OwnerRegistry(Generic[V]):
    """The ``ParameterMap`` of every live owner of one kind, asked newest first ([Note: parameter owners]).

    With ``weak=True`` a map stays listed while its owner holds it (an engine); otherwise it stays listed
    until it is empty (a ``zero.Init`` context, which user code drops right after its ``with`` block while
    its parameters wait for ``initialize``).
    """

    def __init__(self, *, weak: bool) -> None:
        self._weak = weak
        self._weak_maps: list[weakref.ref[ParameterMap[V]]] = []
        self._maps: list[ParameterMap[V]] = []

    def add(self, owned: ParameterMap[V]) -> None:
        """List ``owned`` (again: a ``weak=False`` map is dropped while empty, so add it after filling it)."""
        if self._weak:
            if all(ref() is not owned for ref in self._weak_maps):
                self._weak_maps.append(weakref.ref(owned))
        elif all(m is not owned for m in self._maps):
            self._maps.append(owned)

    def live(self) -> list[ParameterMap[V]]:
        """The listed maps, newest first; dead and (for ``weak=False``) empty ones are dropped here."""
        if self._weak:
            self._weak_maps = [ref for ref in self._weak_maps if ref() is not None]
            maps = [m for m in (ref() for ref in self._weak_maps) if m is not None]
        else:
            self._maps = [m for m in self._maps if len(m)]
            maps = list(self._maps)
        return maps[::-1]

    def find(self, param: nn.Parameter) -> V | None:
        """The newest listed owner's value for ``param``, or ``None``."""
        for owned in self.live():
            value = owned.get(param)
            if value is not None:
                return value
        return None
