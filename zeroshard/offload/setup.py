"""What the offload blocks of a config turn into: where masters live, and the NVMe swappers.

* ``offload_optimizer.device: cpu``: beside a GPU the master shards and optimizer state live in (pinned)
  CPU memory and the step runs on the CPU, overlapped with the copies (``host_step.py``); on a CPU-only
  machine they already do, and nothing changes.
* ``offload_param.device: cpu`` (stage 3) beside a GPU: each unit's compute-dtype parameter shard lives
  in pinned CPU memory and goes to the GPU ahead of its gather (``host_shards.py``, [Note: offload beside
  a device]), with or without the optimizer in CPU memory; on a CPU-only machine it changes nothing.
* ``offload_optimizer.device: nvme``: masters and optimizer state live in a per-rank file under
  ``nvme_path`` between steps (``swapper.OptimizerStateSwapper``), stepped in sub-groups.
* ``offload_param.device: nvme`` (stage 3, with the optimizer on NVMe): each unit's compute-dtype
  parameter shard lives in a second file between uses (``param_swap.ParamShardStore``). Without the
  optimizer on NVMe a gather reads the in-memory master and there is no separate shard to move: the block
  is ignored with a warning.

Offload at a stage without the state to offload is ignored with a note, as DeepSpeed ignores it
(``config/checks.py`` says so when the config is read).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.config import ZeroshardConfig
from zeroshard.core.comm import Comm
from zeroshard.core.copies import Copies, copies_between_host_and
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.grad_sync import GradientReducer
from zeroshard.core.optimizer import OffloadedStep
from zeroshard.core.partitioned import full_numel
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.stages import StagePlan
from zeroshard.offload.host_shards import HostShards, StagingRing
from zeroshard.offload.host_step import HostStep
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
    # Beside a GPU, state in CPU memory ([Note: offload beside a device]): the copies between the two,
    # whether stage-3 parameter shards live there, and the step over masters there.
    host_copies: Copies | None = None
    params_on_host: bool = False
    host_step: HostStep | None = None
    pin: bool = True
    _staging: StagingRing | None = None

    @property
    def on_unit(self) -> Callable[[FlatUnit], None] | None:
        """What to do with each unit as soon as it is built (move its master and shard to NVMe, or give it
        the store of state in CPU memory)."""
        if self.optimizer_swapper is not None:
            return self._adopt
        return self._adopt_host if self.host_copies is not None else None

    def _adopt_host(self, unit: FlatUnit) -> None:
        if self.host_copies is None:
            return
        if self._staging is None:
            self._staging = StagingRing(self.host_copies, unit.policy.compute, self.pin)
        unit.store = HostShards(
            unit,
            self.host_copies,
            self._staging,
            params_on_host=self.params_on_host and unit.plan.shard_parameters,
            pin=self.pin,
        )
        if self.host_step is not None:
            self.host_step.adopt(unit)

    def _adopt(self, unit: FlatUnit) -> None:
        if self.optimizer_swapper is None:
            return
        groups = self.optimizer_swapper.adopt(unit)
        if self.param_store is not None and unit.plan.shard_parameters:
            self.param_store.adopt(unit, groups, self.optimizer_swapper.stores[unit.index])
        release_free_memory()

    def step_over(
        self,
        slices: Sequence[OptimizerSlice],
        optimizer: torch.optim.Optimizer | None,
        reducer: GradientReducer,
    ) -> OffloadedStep | None:
        """The step over offloaded masters, if any, for ``ShardedStep``: the NVMe swapper (bound already), or
        the step over masters in CPU memory, bound to ``optimizer`` here, whose gradient shards start their
        copies to the CPU as ``reducer``'s reductions finish ([Note: overlapped offload step])."""
        if self.host_step is None or optimizer is None:
            return self.optimizer_swapper
        self.host_step.bind(slices, optimizer)
        reducer.on_final_grads = self.host_step.grads_ready
        return self.host_step

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
        if self.host_step is not None:
            self.host_step.close()

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
    params = zero.offload_param
    params_to_cpu = plan.shard_parameters and params.device == "cpu" and block.device != "nvme"
    to_cpu = params_to_cpu or (plan.shard_optimizer and block.device == "cpu")
    copies = host_copies_for(compute_device) if to_cpu else None
    if copies is not None and params_to_cpu:
        out.host_copies, out.params_on_host = copies, True
        out.pin = params.pin_memory and compute_device.type == "cuda"
    if not plan.shard_optimizer or block.device == "none":
        return out
    if block.ratio < 1.0 and comm.rank == 0:
        logger.warning(
            "zero_optimization.offload_optimizer.ratio %g: zeroshard offloads all optimizer state "
            "(partial offload is not implemented)",
            block.ratio,
        )
    if block.device == "cpu":
        if copies is not None:
            out.master_device = torch.device("cpu")
            out.host_copies, out.pin = copies, block.pin_memory and compute_device.type == "cuda"
            out.host_step = HostStep(copies, zero.sub_group_size, pin=out.pin)
        return out
    if block.nvme_path is None:  # config/checks.py already requires it; kept for type narrowing
        raise ValueError('zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"')
    trainable = sum(full_numel(p) for p in model.parameters() if p.requires_grad)
    shard = -(-trainable // comm.world_size)
    master_bytes = 4 if policy.mixed or plan.shard_parameters else 0
    need = shard * (master_bytes + 4 * ASSUMED_STATES_PER_ELEMENT)
    store = _store(cfg, comm, "offload_optimizer", block.nvme_path, "optimizer", need)
    out.optimizer_swapper = OptimizerStateSwapper(store, zero.sub_group_size)
    if plan.shard_parameters and params.device == "nvme" and params.nvme_path is not None:
        need = shard * policy.compute.itemsize
        out.param_store = ParamShardStore(_store(cfg, comm, "offload_param", params.nvme_path, "param", need))
    return out


def host_copies_for(compute_device: torch.device) -> Copies | None:
    """The copies between CPU memory and ``compute_device``, or None where that is CPU memory itself (then
    offloading to the CPU changes nothing)."""
    if compute_device.type == "cpu":
        return None
    return copies_between_host_and(compute_device)


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
    if params.device == "cpu" and zero.offload_optimizer.device == "nvme":
        logger.warning(
            "zero_optimization.offload_param.device 'cpu' with offload_optimizer.device 'nvme': the "
            "parameter shards stay in the training device's memory (zeroshard moves them to CPU memory "
            "with the optimizer in CPU memory or on the GPU, and to NVMe with the optimizer on NVMe)"
        )
    elif params.device == "nvme" and zero.offload_optimizer.device != "nvme":
        logger.warning(
            "zero_optimization.offload_param.device 'nvme' is ignored: zeroshard keeps parameter shards "
            "on NVMe only together with the optimizer (offload_optimizer.device 'nvme'); otherwise a "
            "gather reads the in-memory master and there is no separate shard to move"
        )
