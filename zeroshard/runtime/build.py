"""``initialize()``: turn a model, an optimizer and a ds_config into a ready engine."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from zeroshard.config import (
    ConfigError,
    ConfigTypeError,
    ConfigWarning,
    ZeroshardConfig,
    load_config,
    resolve_config_source,
)
from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.grad_sync import GradientReducer
from zeroshard.core.hybrid import ShardGroups, hpz_group, shard_groups
from zeroshard.core.inflight import InFlight
from zeroshard.core.optimizer import (
    ShardedStep,
    normalize_param_groups,
    reseat_optimizer,
    shard_param_groups,
)
from zeroshard.core.reduction_groups import Averaging
from zeroshard.core.stage3.coupling import NoGatherer
from zeroshard.core.stage3.gatherer import ParameterGatherer
from zeroshard.core.stage3.secondary import GatherSource
from zeroshard.core.stages import StagePlan, plan_for
from zeroshard.core.units import UnitOptions, UnitRules, build_units
from zeroshard.core_config import loss_scaler_from_config, policy_from_config, unit_rules_from_config
from zeroshard.dist import join_process_group, local_rank, node_layout, training_device
from zeroshard.errors import ArgumentError
from zeroshard.lr_schedules import build_scheduler
from zeroshard.offload.setup import Offload, build_offload
from zeroshard.offload.swapper import OptimizerStateSwapper
from zeroshard.optim_factory import build_optimizer, check_optimizer_for_stage
from zeroshard.runtime.agreement import check_ranks_agree
from zeroshard.runtime.data import ResumableDataLoader, build_loader
from zeroshard.runtime.engine import ZeroshardEngine
from zeroshard.runtime.state_dict_hooks import install_state_dict_hooks
from zeroshard.watchdog import heartbeat
from zeroshard.zero import TrainedParameters

logger = logging.getLogger(__name__)

OptimizerArg = torch.optim.Optimizer | Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: dict[str, Any] | str | None = None,
    config_params: dict[str, Any] | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[ZeroshardEngine, torch.optim.Optimizer | None, DataLoader[Any] | None, Any]:
    """Wrap ``model`` for ZeRO training; DeepSpeed's ``deepspeed.initialize`` signature and return value.

    Collective: call on all ranks of the data-parallel group (default: the whole world).

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``. ``optimizer`` is a torch optimizer over this
        rank's shards (the client's own object, re-seated, when one was given); ``dataloader`` is None unless
        ``training_data`` was given.
    """
    model = checked_model(model, mpu)
    join_process_group(dist_init_required)
    # The liveness records this engine's collectives report to, and their heartbeat ([Note: liveness] in
    # watchdog/monitor.py).
    comm = Comm(group, monitor=heartbeat.monitor_for_world())
    heartbeat.start(comm)
    with comm.monitor.api("initialize"):
        comm.nodes = node_layout(comm)  # which bytes cross nodes: core/traffic.py
        client_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        cfg = _read_config(
            model, resolve_config_source(config, config_params, args), client_opt, optimizer, comm
        )
        check_ranks_agree(model, cfg, comm)
        plan = plan_for(cfg.zero_optimization.stage)
        groups = normalize_param_groups(model, client_opt.param_groups if client_opt else model_parameters)
        device = _place_model(model, comm)
        # Stage 0 shards nothing: hybrid sharding has no effect there ([Note: hybrid sharding]).
        shard_size = cfg.zero_optimization.mics_shard_size if plan.shard_optimizer else -1
        sharding = shard_groups(comm, shard_size, gather_channel=plan.shard_parameters)
        if plan.shard_parameters:  # stage 3 only: [Note: hpZ groups]
            hpz = hpz_group(comm, cfg.zero_optimization.zero_hpz_partition_size)
            sharding = dataclasses.replace(sharding, hpz=hpz)
        parts = _build_units(model, cfg, plan, sharding)
        sharded_groups, slices = shard_param_groups(groups, parts.units)
        opt = _build_optimizer(optimizer, cfg, sharded_groups, plan)
        if parts.offload.optimizer_swapper is not None:
            _bind_swapper(parts.offload.optimizer_swapper, slices, opt)
        scheduler = _build_scheduler(lr_scheduler, cfg, opt)
        engine = _assemble_engine(model, cfg, plan, sharding, parts, slices, opt, scheduler, device)
        loader = _build_dataloader(training_data, cfg, comm, collate_fn)
        engine.training_dataloader = loader
        return engine, opt, loader, scheduler


def checked_model(model: nn.Module | None, mpu: Any) -> nn.Module:
    """The ``model=`` argument, refused with DeepSpeed's exception types when it is not a module."""
    if model is None:  # ArgumentError: also DeepSpeed's AssertionError ([Note: DeepSpeed's exception types])
        raise ArgumentError("initialize() needs model=: the torch.nn.Module to train")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None:
        raise ValueError("mpu= (model parallelism) is not supported by zeroshard: it is data parallel only")
    return model


def _read_config(
    model: nn.Module,
    source: Any,
    client_opt: torch.optim.Optimizer | None,
    optimizer: OptimizerArg,
    comm: Comm,
) -> ZeroshardConfig:
    """Validate the ds_config on every rank; rank 0 alone warns and logs it."""
    with warnings.catch_warnings():
        if comm.rank != 0:
            warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_config(
            source,
            world_size=comm.world_size,
            hidden_size=_hidden_size(model),
            model_dtype=next((p.dtype for p in model.parameters()), None),
            client_optimizer=client_opt,
            optimizer_given=optimizer is not None,
        )
    if comm.rank == 0:
        logger.info("zeroshard config:\n%s", cfg.dump())
    return cfg


def _place_model(model: nn.Module, comm: Comm) -> torch.device:
    """Move the model to this rank's device and start every rank from rank 0's values."""
    device = training_device(model, comm)
    model.to(device)  # the same Parameter objects: the client optimizer and zero.Init's shards keep them
    _broadcast_from_rank0(model, comm)
    return device


@dataclasses.dataclass
class _Parts:
    """What ``_build_units`` makes: the units, where their state lives, and the shared buffer pool."""

    units: list[FlatUnit]
    module_units: list[tuple[nn.Module, list[FlatUnit]]]
    offload: Offload
    pool: BufferPool
    rules: UnitRules


def _build_units(model: nn.Module, cfg: ZeroshardConfig, plan: StagePlan, sharding: ShardGroups) -> _Parts:
    policy = policy_from_config(cfg)
    rules = unit_rules_from_config(cfg)
    offload = build_offload(cfg, plan, policy, model, sharding.world)  # no offload when hybrid (checks.py)
    pool = BufferPool()  # transient flat buffers reused across units: see buffers.py, sized below
    options = UnitOptions(offload.master_device, offload.on_unit, pool, init_comm=sharding.world)
    built = build_units(model, rules, plan, policy, sharding.shard, options)
    # Idle buffers fill the room below the high-water mark plus two bucket-sized units ([Note: bounded
    # units]), or the largest unit if smaller: the spare adds to peak RSS in every backward. On the
    # large bench GPT at stage 3 one largest unit (its 64 MiB embedding) held the backward above
    # FSDP2's peak; two bucket-sized units (32 MiB) cost about 30 pool misses per step, none at all
    # about 80 ([Note: buffer reuse]).
    itemsize = max(policy.compute.itemsize, policy.reduce.itemsize)
    largest = max((u.layout.padded for u in built.units), default=0)
    pool.spare_bytes = itemsize * min(largest, 2 * rules.unit_elements)
    if policy.mixed:
        # Frozen parameters and floating buffers follow the compute dtype; unit parameters already do.
        model.to(dtype=policy.compute)
    return _Parts(built.units, built.module_units, offload, pool, rules)


def _bind_swapper(
    swapper: OptimizerStateSwapper, slices: list[OptimizerSlice], opt: torch.optim.Optimizer | None
) -> None:
    """NVMe optimizer offload swaps the optimizer's state per shard slice: it needs an optimizer."""
    if opt is None:
        raise ValueError(
            "zero_optimization.offload_optimizer.device 'nvme' needs an optimizer: pass "
            "optimizer= to initialize() or add an 'optimizer' block"
        )
    swapper.bind(slices, opt)


def _build_sync(
    model: nn.Module, cfg: ZeroshardConfig, plan: StagePlan, sharding: ShardGroups, parts: _Parts
) -> tuple[GradientReducer, ParameterGatherer | None]:
    """The gradient reducer (every stage) and, at stage 3, the parameter gatherer, built first and handed to
    the reducer ([Note: reducer and gatherer])."""
    zero = cfg.zero_optimization
    inflight = InFlight()  # the reducer launches its reductions into it; the gatherer may retire them
    gatherer = None
    if parts.module_units:
        if sharding.gather is None:
            raise RuntimeError(f"rank {sharding.world.rank}: stage-3 units were built without a gather group")
        gatherer = ParameterGatherer(
            parts.module_units,
            # Parameter gathers on their own group (see Comm.new_channel); later gathers from hpZ's secondary
            # shards (stage3/secondary.py), first ones in int8 with qwZ.
            GatherSource(sharding.gather, sharding.hpz, quantized=zero.zero_quantized_weights),
            prefetch_elements=zero.prefetch_bucket_size,
            max_live_elements=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            pool=parts.pool,
            reductions=inflight,
        )
    reducer = GradientReducer(
        parts.units,
        sharding.shard,
        plan,
        # Averaged over every rank, also where the units shard over fewer ([Note: hybrid sharding]).
        Averaging(sharding.world.world_size, cfg.prescale_gradients, cfg.gradient_predivide_factor),
        overlap_comm=zero.overlap_comm,
        pool=parts.pool,
        # Coalesced stage-3 buckets are bounded like stage 0-2 units ([Note: bounded units]): with
        # MAX_INFLIGHT reductions in flight, larger ones would hold that many times their size.
        bucket_elements=parts.rules.unit_elements,
        params=gatherer if gatherer is not None else NoGatherer(gathers=plan.shard_parameters),
        inflight=inflight,
        replica=sharding.replica,
        quantized=zero.zero_quantized_gradients and plan.shard_parameters,  # stage 3 only, as DeepSpeed
    )
    reducer.register_hooks()
    if gatherer is not None:
        gatherer.register(model)
    return reducer, gatherer


def _assemble_engine(
    model: nn.Module,
    cfg: ZeroshardConfig,
    plan: StagePlan,
    sharding: ShardGroups,
    parts: _Parts,
    slices: list[OptimizerSlice],
    opt: torch.optim.Optimizer | None,
    scheduler: Any,
    device: torch.device,
) -> ZeroshardEngine:
    """Wire the units to the reducer, the gatherer and the sharded step, and make the engine over them."""
    reducer, gatherer = _build_sync(model, cfg, plan, sharding, parts)
    comm, shard = sharding.world, sharding.shard
    trained = TrainedParameters(parts.units, gatherer, comm, shard=shard, optimizer=opt, slices=slices)
    install_state_dict_hooks(model, trained)
    return ZeroshardEngine(
        model,
        config=cfg,
        plan=plan,
        comm=comm,
        sharding=sharding,
        units=parts.units,
        reducer=reducer,
        sharded_step=ShardedStep(
            parts.units,
            slices,
            sharding.shard,
            plan,
            allgather_bucket_size=cfg.zero_optimization.allgather_bucket_size,
            swapper=parts.offload.step_over(slices, opt, reducer),
            replica=sharding.replica,
        ),
        offload=parts.offload,
        optimizer=opt,
        lr_scheduler=scheduler,
        local_rank=local_rank(),
        device=device,
        loss_scaler=loss_scaler_from_config(cfg),
        gatherer=gatherer,
        trained=trained,
    )


def _hidden_size(model: nn.Module) -> int | None:
    """The model's hidden size when it says (a Hugging Face config), for resolving "auto" bucket sizes."""
    hf_config = getattr(model, "config", None)
    for key in ("hidden_size", "d_model", "n_embd"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int):
            return value
    return None


def _broadcast_from_rank0(model: nn.Module, comm: Comm) -> None:
    """Start every rank from rank 0's parameters and buffers, as DeepSpeed does (before any cast)."""
    if comm.world_size == 1:
        return
    tensors = [p.data for p in model.parameters()] + list(model.buffers())
    for pending in [comm.broadcast_from_first(t, what="initial parameter broadcast") for t in tensors]:
        pending.wait()
    comm.stats.reset()  # count training traffic only


def _build_optimizer(
    optimizer: OptimizerArg, cfg: ZeroshardConfig, sharded_groups: list[dict[str, Any]], plan: StagePlan
) -> torch.optim.Optimizer | None:
    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_for_stage(type(optimizer), plan.stage, type_label=type(optimizer).__name__)
        if cfg.optimizer is not None:
            logger.warning(
                "both a client optimizer and an 'optimizer' config block were given: using the client's"
            )
        if optimizer.state:
            logger.warning(
                "the client optimizer's existing state is discarded: zeroshard keeps state per shard"
            )
        reseat_optimizer(optimizer, sharded_groups)
        return optimizer
    if callable(optimizer):
        built = optimizer(sharded_groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer= callable returned {type(built).__name__}, not a torch.optim.Optimizer"
            )
        check_optimizer_for_stage(type(built), plan.stage, type_label=type(built).__name__)
        return built
    if optimizer is not None:
        raise TypeError(
            f"optimizer= must be a torch.optim.Optimizer or a callable params -> Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if (block := cfg.optimizer) is None:
        return None
    on_host = plan.shard_optimizer and cfg.zero_optimization.offload_optimizer.device != "none"
    try:
        return build_optimizer(block.type, block.params, sharded_groups, stage=plan.stage, offloaded=on_host)
    except (TypeError, ValueError) as err:
        raise _does_not_fit(err) from err


def _build_scheduler(lr_scheduler: Any, cfg: ZeroshardConfig, opt: torch.optim.Optimizer | None) -> Any:
    if (
        lr_scheduler is not None
        and not callable(getattr(lr_scheduler, "step", None))
        and callable(lr_scheduler)
    ):
        if opt is None:
            raise ValueError("lr_scheduler= callable needs an optimizer to be built first")
        return lr_scheduler(opt)
    if lr_scheduler is not None:
        if cfg.scheduler is not None:
            logger.warning(
                "both a client lr_scheduler and a 'scheduler' config block were given: using the client's"
            )
        return lr_scheduler
    if cfg.scheduler is None:
        return None
    if opt is None:
        raise ValueError(
            "scheduler: a 'scheduler' config block needs an optimizer (config 'optimizer' or optimizer=)"
        )
    try:
        return build_scheduler(cfg.scheduler.type, cfg.scheduler.params, opt)
    except (TypeError, ValueError) as err:
        raise _does_not_fit(err) from err


def _does_not_fit(err: TypeError | ValueError) -> ConfigError:
    """`load_config` built the config's optimizer and schedule over a stand-in parameter already (see
    [Note: one validation] in config/checks.py); what fails now depends on the model, such as a per-group
    list (`warmup_max_lr: [a, b]`) whose length is not the number of param groups."""
    kind = ConfigTypeError if isinstance(err, TypeError) else ConfigError
    return kind(f"ds_config does not fit this model's parameter groups: {err}")


def _build_dataloader(
    data: Dataset[Any] | None, cfg: ZeroshardConfig, comm: Comm, collate_fn: Callable[..., Any] | None
) -> ResumableDataLoader | None:
    """DeepSpeed's loader (a DistributedSampler, the micro batch per rank), resumable from a checkpoint."""
    if data is None:
        return None
    return build_loader(
        data,
        rank=comm.rank,
        world_size=comm.world_size,
        micro_batch_size=cfg.train_micro_batch_size_per_gpu,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
        accumulation_steps=cfg.gradient_accumulation_steps,
    )
