"""[Note: shard stores]: a unit reaches its shards only through the store it holds (no processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit, InMemoryShards
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.stages import plan_for
from zeroshard.offload.unit_store import OffloadedMaster


class RecordingStore(InMemoryShards):
    """The in-memory store, recording what the unit asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def param_shard(self, unit: FlatUnit) -> torch.Tensor:
        self.calls.append("param_shard")
        return super().param_shard(unit)

    def gathered(self, unit: FlatUnit) -> None:
        self.calls.append("gathered")

    def write_stepped(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        self.calls.append(f"write_stepped {start}:{start + values.numel()}")
        super().write_stepped(unit, start, values)

    def take_full(self, unit: FlatUnit, shard: torch.Tensor) -> None:
        self.calls.append("take_full")
        super().take_full(unit, shard)


class LocalComm:
    """World size 1: an all-gather is a copy."""

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, what: str) -> Any:
        full.copy_(shard)
        return type("Done", (), {"wait": lambda self: None})()


def _unit(stage: int, policy: DtypePolicy | None = None) -> tuple[FlatUnit, list[nn.Parameter]]:
    params = [nn.Parameter(torch.arange(7.0)), nn.Parameter(torch.ones(3, 5))]
    unit = FlatUnit(
        0, params, ["a", "b"], rank=0, world_size=1, plan=plan_for(stage), policy=policy or DtypePolicy()
    )
    return unit, params


def test_a_stage3_unit_gathers_and_writes_through_its_store() -> None:
    unit, params = _unit(3)
    store = RecordingStore()
    unit.store = store
    comm: Comm = LocalComm()  # type: ignore[assignment]
    unit.start_gather(comm)
    unit.finish_gather()
    assert torch.equal(params[0], torch.arange(7.0)) and store.calls == ["param_shard", "gathered"]
    unit.take_stepped_master(0, torch.full((7,), 2.0))
    assert torch.equal(unit.master[:7], torch.full((7,), 2.0))  # the in-memory store: into the master
    with torch.no_grad():
        params[1].fill_(3.0)  # changed by hand while gathered
    unit.copy_full_to_master()
    assert store.calls[2:] == ["write_stepped 0:7", "param_shard", "take_full"]
    assert torch.equal(unit.master[:22], torch.cat([torch.arange(7.0), torch.full((15,), 3.0)]))


def test_an_offloaded_master_keeps_a_compute_copy_and_marks_changes_stale() -> None:
    unit, _ = _unit(3, DtypePolicy(compute=torch.bfloat16))
    store = OffloadedMaster(unit, unit.master)
    master = unit.move_master(store)
    assert master.dtype == torch.float32 and unit.master.numel() == 0
    shard = unit.param_shard
    assert shard.dtype == torch.bfloat16 and torch.equal(shard[:7].float(), torch.arange(7.0))
    assert [sl.master.numel() for sl in unit.optimizer_slices()] == [0, 0]  # pointed at storage when resident
    held = unit.bytes_held()
    assert held["master"] == 0 and held["parameters"] == shard.numel() * 2
    assert not store.stale
    unit.start_gather(LocalComm())  # type: ignore[arg-type]
    unit.finish_gather()
    unit.copy_full_to_master()
    assert store.stale  # the swapper re-derives the master before it next reads it
    unit.take_stepped_master(0, torch.full((7,), 5.0))
    assert torch.equal(unit.param_shard[:7].float(), torch.full((7,), 5.0))
