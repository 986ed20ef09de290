"""The engine's read-only queries: the accumulation boundary, learning rates, and what its state and
traffic measure.

A base of :class:`zeroshard.ZeroshardEngine`; the attributes below are the engine's own, set by its
``__init__``. Nothing here communicates.
"""

from __future__ import annotations

import torch

from zeroshard.config import ZeroshardConfig
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.grad_sync import GradientReducer
from zeroshard.core.hybrid import ShardGroups
from zeroshard.core.memory import MemoryBreakdown, measure
from zeroshard.core.stages import StagePlan
from zeroshard.offload.setup import Offload


class EngineMeasurements:
    """Queries over the engine's state (see the module docstring)."""

    config: ZeroshardConfig
    comm: Comm
    units: list[FlatUnit]
    optimizer: torch.optim.Optimizer | None
    plan: StagePlan
    sharding: ShardGroups
    reducer: GradientReducer
    offload: Offload
    micro_steps: int
    _boundary_override: bool | None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an accumulation window (and so updates the parameters)."""
        if self._boundary_override is not None:  # set_gradient_accumulation_boundary (surface.py)
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def memory_breakdown(self) -> MemoryBreakdown:
        """This rank's model-state bytes, measured from the tensors it holds, and the formula's prediction."""
        return measure(
            self.units,
            self.optimizer,
            stage=self.plan.stage,
            world_size=self.sharding.shard.world_size,  # the ranks the state is sharded over
            communication_buffers=self.reducer.peak_bucket_bytes,
            offloaded=self.offload.offloaded_bytes(),
            cached_buffers=self.reducer.pool.idle_bytes,
        )

    def communication_bytes(self) -> int:
        """Bytes moved by model-state collectives since the engine was built (see comm.py)."""
        return self.comm.stats.total_bytes

    def communication_bytes_by_group(self) -> dict[str, int]:
        """:meth:`communication_bytes` by the group each collective ran on: ``"world"`` (every rank, plain
        ZeRO), ``"shard"`` and ``"replica"`` (hybrid sharding: hybrid.py [Note: hybrid sharding]),
        ``"gather"`` (stage 3's parameter gathers), ``"hpz"`` (with hpZ, stage 3's backward gathers from
        secondary shards: hybrid.py [Note: hpZ groups])."""
        return {group: n for group, n in self.comm.stats.bytes_by_group.items() if n}

    def cross_node_bytes(self) -> int:
        """Bytes this rank sent to ranks on other nodes since the engine was built, by the model-state
        collectives (core/traffic.py [Note: bytes across nodes]); per step: the difference across it."""
        return self.comm.stats.cross_node_bytes
