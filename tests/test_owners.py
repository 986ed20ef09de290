"""[Note: parameter owners]: state found from a parameter lives with its owner, and goes with it."""

from __future__ import annotations

import copy
import gc

import torch
from torch import nn

import zeroshard
from zeroshard.core.owners import OwnerRegistry, ParameterMap
from zeroshard.core.stage3.module_marks import external_parameters, leaf_classes


def test_a_parameter_map_forgets_a_parameter_when_it_is_collected() -> None:
    owned: ParameterMap[str] = ParameterMap()
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    owned[a], owned[b] = "a", "b"
    assert owned.get(a) == "a" and b in owned and len(owned) == 2
    del a
    gc.collect()
    assert len(owned) == 1 and list(owned.values()) == ["b"]
    assert owned.pop(b) == "b" and owned.get(b) is None and len(owned) == 0


def test_the_registry_asks_live_owners_newest_first_and_shares_no_entries() -> None:
    engines: OwnerRegistry[str] = OwnerRegistry(weak=True)
    p, q = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))
    first: ParameterMap[str] = ParameterMap()
    second: ParameterMap[str] = ParameterMap()
    first[p], second[p], second[q] = "first", "second", "second"
    engines.add(first)
    engines.add(second)
    engines.add(second)  # listed once
    assert engines.find(p) == "second" and len(engines.live()) == 2
    del second  # the owner let go of its map: its entries go with it
    gc.collect()
    assert engines.find(p) == "first" and engines.find(q) is None and len(first) == 1

    inits: OwnerRegistry[str] = OwnerRegistry(weak=False)
    partitioned: ParameterMap[str] = ParameterMap()
    partitioned[p] = "shard"
    inits.add(partitioned)
    del partitioned  # a zero.Init context dropped after its block: still listed while it holds parameters
    assert inits.find(p) == "shard"
    del p
    gc.collect()
    assert inits.live() == []


def test_marks_live_on_the_module_and_follow_a_copy() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    zeroshard.set_z3_leaf_modules(model, [nn.Linear])
    zeroshard.register_external_parameter(model[1], model[0].weight)
    zeroshard.register_external_parameter(model[1], model[0].weight)  # declared once
    assert leaf_classes(model) == (nn.Linear,) and leaf_classes(model[0]) == ()
    assert external_parameters(model[1]) == [model[0].weight] and external_parameters(model[0]) == []
    assert len(list(model.modules())) == 3 and len(model.state_dict()) == 4  # no module or tensor added
    twin = copy.deepcopy(model)
    assert leaf_classes(twin) == (nn.Linear,)
    assert [p is twin[0].weight for p in external_parameters(twin[1])] == [True]
