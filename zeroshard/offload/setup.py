"""What the offload blocks of a config turn into: where masters live, and the NVMe swappers.

* ``offload_optimizer.device: cpu``: beside a GPU the master shards and optimizer state live in (pinned)
  CPU memory and the step runs on the CPU; on a CPU-only machine they already do, and nothing changes.
* ``offload_optimizer.device: nvme``: masters and optimizer state live in a per-rank file under
  ``nvme_path`` between steps (``swapper.OptimizerStateSwapper``), stepped in sub-groups.
* ``offload_param.device: nvme`` (stage 3, with the optimizer on NVMe): each unit's compute-dtype
  parameter shard lives in a second file between uses (``param_swap.ParamShardStore``). Without the
  optimizer on NVMe a gather reads the in-memory master and there is no separate shard to move: the block
  is ignored with a warning. ``offload_param.device: cpu`` beside a GPU, with the optimizer in CPU
  memory: the gathers read each shard from the pinned CPU master (no parameter shard stays on the GPU);
  on a CPU-only machine it changes nothing.

Offload at a stage without the state to offload is ignored with a note, as DeepSpeed ignores it
(``config/checks.py`` says so when the config is read).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.config import ZeroshardConfig
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.partitioned import full_numel
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.stages import StagePlan
from zeroshard.offload.malloc import release_free_memory
from zeroshard.offload.nvme import AioSettings, NvmeStore
from zeroshard.offload.param_swap import ParamShardStore
from zeroshard.offload.swapper import OptimizerStateSwapper

logger = logging.getLogger(__name__)

# Per-element optimizer state assumed when sizing the file before the optimizer exists (Adam's two
# moments); the file grows, with the same free-space check, if an optimizer keeps more.
ASSUMED_STATES_PER_ELEMENT = 2


@dataclass
class Offload:
    """The offload set-up of one engine (all fields None/False: nothing offloaded)."""

    master_device: torch.device | None = None
    optimizer_swapper: OptimizerStateSwapper | None = None
    param_store: ParamShardStore | None = None

    @property
    def on_unit(self) -> Callable[[FlatUnit], None] | None:
        """What to do with each unit as soon as it is built (move its master and shard to NVMe)."""
        return self._adopt if self.optimizer_swapper is not None else None

    def _adopt(self, unit: FlatUnit) -> None:
        if self.optimizer_swapper is None:
            return
        groups = self.optimizer_swapper.adopt(unit)
        if self.param_store is not None and unit.plan.shard_parameters:
            self.param_store.adopt(unit, groups, self.optimizer_swapper.stores[unit.index])
        release_free_memory()

    def offloaded_bytes(self) -> int:
        """Model-state bytes this rank keeps in NVMe files."""
        stores = (self.optimizer_swapper, self.param_store)
        return sum(s.offloaded_bytes() for s in stores if s is not None)

    def close(self) -> None:
        """Wait for outstanding I/O and remove this rank's offload files."""
        if self.param_store is not None:
            self.param_store.synchronize()
            self.param_store.store.close()
        if self.optimizer_swapper is not None:
            self.optimizer_swapper.close()

    def resident(self, write_back: bool) -> contextlib.AbstractContextManager[None]:
        """All offloaded optimizer state in memory for the block (see ``OptimizerStateSwapper.resident``)."""
        if self.optimizer_swapper is None:
            return contextlib.nullcontext()
        return self.optimizer_swapper.resident(write_back)


def build_offload(
    cfg: ZeroshardConfig, plan: StagePlan, policy: DtypePolicy, model: nn.Module, comm: Comm
) -> Offload:
    """Read the offload blocks; create and check this rank's NVMe files (before any unit is built)."""
    zero = cfg.zero_optimization
    block = zero.offload_optimizer
    out = Offload()
    compute_device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if comm.rank == 0:
        _notes(cfg, plan, compute_device)
    if not plan.shard_optimizer or block.device == "none":
        return out
    if block.ratio < 1.0 and comm.rank == 0:
        logger.warning(
            "zero_optimization.offload_optimizer.ratio %g: zeroshard offloads all optimizer state "
            "(partial offload is not implemented)",
            block.ratio,
        )
    if block.device == "cpu":
        if compute_device.type != "cpu":
            out.master_device = torch.device("cpu")
        return out
    if block.nvme_path is None:  # config/checks.py already requires it; kept for type narrowing
        raise ValueError('zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"')
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    shard = -(-trainable // comm.world_size)
    master_bytes = 4 if policy.mixed or plan.shard_parameters else 0
    need = shard * (master_bytes + 4 * ASSUMED_STATES_PER_ELEMENT)
    store = _store(cfg, comm, "offload_optimizer", block.nvme_path, "optimizer", need)
    out.optimizer_swapper = OptimizerStateSwapper(store, zero.sub_group_size)
    params = zero.offload_param
    if plan.shard_parameters and params.device == "nvme" and params.nvme_path is not None:
        need = shard * policy.compute.itemsize
        out.param_store = ParamShardStore(_store(cfg, comm, "offload_param", params.nvme_path, "param", need))
    return out


def _store(cfg: ZeroshardConfig, comm: Comm, block: str, path: str, purpose: str, need: int) -> NvmeStore:
    """This rank's file for ``purpose`` under ``path`` (checked and preallocated to ``need`` bytes)."""
    store = NvmeStore(
        path,
        rank=comm.rank,
        purpose=purpose,
        capacity_bytes=need,
        aio=AioSettings.from_config(cfg.aio),
        config_key=f"zero_optimization.{block}.nvme_path",
    )
    if comm.rank == 0:
        logger.info("%s: %s state on %s, about %.2f GB per rank", block, purpose, path, need / 1e9)
    return store


def _notes(cfg: ZeroshardConfig, plan: StagePlan, compute_device: torch.device) -> None:
    """Say once (rank 0) which offload settings change nothing here, and why."""
    zero = cfg.zero_optimization
    for key, block in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param)):
        if block.device == "cpu" and compute_device.type == "cpu":
            logger.warning(
                "zero_optimization.%s.device 'cpu': training runs on the CPU, where this state already "
                "lives, so offloading to CPU changes nothing",
                key,
            )
    params = zero.offload_param
    if not plan.shard_parameters:
        return  # config/checks.py notes that offload_param needs stage 3
    if params.device == "cpu" and compute_device.type != "cpu" and zero.offload_optimizer.device != "cpu":
        logger.warning(
            "zero_optimization.offload_param.device 'cpu' needs offload_optimizer.device 'cpu' beside a "
            "GPU: then each gather reads the parameter shard from the pinned CPU master; without it the "
            "shards stay in GPU memory"
        )
    elif params.device == "nvme" and zero.offload_optimizer.device != "nvme":
        logger.warning(
            "zero_optimization.offload_param.device 'nvme' is ignored: zeroshard keeps parameter shards "
            "on NVMe only together with the optimizer (offload_optimizer.device 'nvme'); otherwise a "
            "gather reads the in-memory master and there is no separate shard to move"
        )
