"""[Note: shard stores]: a unit reaches its shards only through the store it holds (no processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.shard_store import InMemoryShards, UnitBuffers
from zeroshard.core.stages import plan_for
from zeroshard.offload.unit_store import OffloadedMaster


class RecordingStore(InMemoryShards):
    """The in-memory store, recording what the unit asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def param_shard(self, unit: UnitBuffers) -> torch.Tensor:
        self.calls.append("param_shard")
        return super().param_shard(unit)

    def gathered(self, unit: UnitBuffers) -> None:
        self.calls.append("gathered")

    def master_to_full(self, unit: UnitBuffers, values: torch.Tensor | None = None, start: int = 0) -> None:
        n = unit.master.numel() if values is None else values.numel()
        self.calls.append(f"master_to_full {start}:{start + n}")
        super().master_to_full(unit, values, start)

    def full_to_master(self, unit: UnitBuffers, full_shard: torch.Tensor) -> None:
        self.calls.append("full_to_master")
        super().full_to_master(unit, full_shard)


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
    unit.master_to_full(torch.full((7,), 2.0))
    assert torch.equal(unit.master[:7], torch.full((7,), 2.0))  # the in-memory store: into the master
    unit.master_to_full()  # stepped in place: the master is the parameter shard, nothing to copy
    with torch.no_grad():
        params[1].fill_(3.0)  # changed by hand while gathered
    unit.full_to_master()
    expected = ["master_to_full 0:7", "param_shard", "master_to_full 0:22", "param_shard", "full_to_master"]
    assert store.calls[2:] == expected
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
    unit.full_to_master()
    assert store.stale  # the swapper re-derives the master before it next reads it
    unit.master_to_full(torch.full((7,), 5.0))
    assert torch.equal(unit.param_shard[:7].float(), torch.full((7,), 5.0))


def test_master_to_full_casts_the_master_into_the_full_buffer_and_full_to_master_reads_it_back() -> None:
    unit, params = _unit(2, DtypePolicy(compute=torch.bfloat16))
    assert unit.separate_master and unit.master.dtype == torch.float32
    with torch.no_grad():
        unit.master.copy_(torch.arange(22.0) / 4)
    unit.master_to_full()  # stepped in place: the whole master, cast
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[0].float(), torch.arange(7.0) / 4)
    unit.master_to_full(torch.full((3,), 4.0), start=7)  # stepped elsewhere: a range
    assert torch.equal(params[1].flatten()[:4].float(), torch.tensor([4.0, 4.0, 4.0, 2.5]))
    assert torch.equal(unit.master[7:10], torch.arange(7.0, 10.0) / 4)  # the master is not written
    with torch.no_grad():
        params[0].fill_(2.0)
    unit.full_to_master()
    assert torch.equal(unit.master[:7], torch.full((7,), 2.0)) and unit.master[7] == 4.0


def test_an_offloaded_master_at_stage_2_is_written_only_while_resident() -> None:
    unit, params = _unit(2, DtypePolicy(compute=torch.bfloat16))
    store = OffloadedMaster(unit, unit.master)
    unit.move_master(store)
    assert store.held_param_shard() is None  # the full buffer holds the parameters
    unit.master_to_full()  # the master is in its file: nothing in memory to write
    assert torch.equal(params[0].float(), torch.arange(7.0))
    unit.master = torch.full((22,), 6.0)  # made resident (OptimizerStateSwapper.resident)
    unit.master_to_full()
    assert torch.equal(params[1].float(), torch.full((3, 5), 6.0))
    unit.master_to_full(torch.full((2,), 7.0), start=5)
    assert torch.equal(params[0][4:].float(), torch.tensor([6.0, 7.0, 7.0]))
    with torch.no_grad():
        params[0].fill_(1.0)
    unit.full_to_master()
    assert store.stale and unit.master[0] == 6.0  # re-derived from the parameters by the swapper
