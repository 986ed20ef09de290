"""Which parameters are communicated together: building the units of a model.

* Stages 0-2: consecutive trainable parameters, in registration order, in units of at most
  ``min(reduce_bucket_size, MAX_UNIT_ELEMENTS)`` elements (a larger parameter alone), see [Note: bounded
  units].
* Stage 3 (DeepSpeed's default granularity): one unit per module that directly owns trainable parameters,
  in module order. A module whose parameters total at most ``stage3_param_persistence_threshold`` elements
  keeps them full on every rank (consecutive such modules share a stage-2-like unit). A leaf module
  (``set_z3_leaf_modules``, ``zero_optimization.leaf_module``, or a module finer than
  ``stage3_module_granularity_threshold``, see :func:`granularity_leaves`) owns its whole subtree as one
  unit.

A parameter shared by several modules (tied weights) belongs to the first module that owns it; every
module that owns it directly gathers that unit before computing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.modules.container as containers
from torch import nn

from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit, unique_units
from zeroshard.core.partitioned import full_numel, materialize
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.stage3.module_marks import external_parameters, is_leaf, leaf_classes, set_leaf
from zeroshard.core.stages import STAGES, StagePlan

logger = logging.getLogger(__name__)

Named = list[tuple[str, nn.Parameter]]

# [Note: bounded units]
# A unit's gradient is reduced in one collective once all of it has arrived, so the transient gradient
# bucket of a unit that shards gradients (stage 2, stage 3's persistent units) is as large as the unit.
# Were units as large as ``reduce_bucket_size`` (5e8 elements by DeepSpeed's default, more than most
# models), stage 2 would hold a full-size gradient during every backward and save nothing over stage 1.
# So units of stages 0-2 are also capped at MAX_UNIT_ELEMENTS: the gradient buckets a rank holds are then
# bounded by the cap (or the largest parameter) times the buckets in flight, whatever the model's size.
# 2**22 fp32 elements (16 MiB) are large enough that a collective's fixed cost is small next to moving
# them (gloo on CPU and NCCL alike), and small next to any model where the difference matters.
MAX_UNIT_ELEMENTS = 1 << 22

# DeepSpeed never makes a module of more parameters than this a leaf by granularity (its Z3_MAX_LEAF_SIZE).
MAX_LEAF_ELEMENTS = 10**9


@dataclass(frozen=True, kw_only=True)
class UnitRules:
    """How a model's parameters are grouped into units: the ``zero_optimization`` settings that decide it
    (``zeroshard.core_config.unit_rules_from_config`` reads them from the config)."""

    reduce_bucket_size: int
    """Bucket-sized units (stages 0-2, stage 3's persistent parameters) hold at most this many elements,
    and never more than ``MAX_UNIT_ELEMENTS`` (see :attr:`unit_elements`)."""
    param_persistence_threshold: int
    """Stage 3: a module whose parameters total at most this many elements keeps them full on every rank."""
    module_granularity_threshold: int
    """Stage 3: modules at or below this granularity become leaves (see :func:`granularity_leaves`)."""
    leaf_class_names: tuple[str, ...]
    """Stage 3: module classes (fully qualified or bare names) whose subtree is one unit."""
    leaf_names: tuple[str, ...]
    """Stage 3: module names (as in ``named_modules()``) whose subtree is one unit."""
    leaf_name_suffixes: tuple[str, ...]
    """Stage 3: suffixes of module names whose subtree is one unit."""

    @property
    def unit_elements(self) -> int:
        """The most elements a bucket-sized unit (stages 0-2, stage 3's persistent parameters) holds: see
        [Note: bounded units]."""
        return min(self.reduce_bucket_size, MAX_UNIT_ELEMENTS)


@dataclass(frozen=True)
class UnitOptions:
    """How each unit is made beyond the stage and dtypes: where its master lives, and a callback run as soon
    as it exists (the NVMe swapper takes its master there, one unit at a time)."""

    master_device: torch.device | None = None
    on_unit: Callable[[FlatUnit], None] | None = None
    pool: BufferPool | None = None  # where stage-3 gathered buffers are reused
    # The data-parallel group zero.Init partitioned over, where units shard over a smaller group (hybrid
    # sharding: hybrid.py [Note: hybrid sharding]); None: the units' own.
    init_comm: Comm | None = None


@dataclass
class ModelUnits:
    units: list[FlatUnit]
    # Stage 3: for each module that computes with gathered parameters, the units it needs.
    module_units: list[tuple[nn.Module, list[FlatUnit]]]


def check_dtypes(model: nn.Module, policy: DtypePolicy) -> None:
    allowed = {torch.float32, policy.compute}
    for name, p in model.named_parameters():
        if p.requires_grad and p.dtype not in allowed:
            raise ValueError(
                f"parameter {name!r} is {p.dtype}; with this config zeroshard trains in {policy.compute} and "
                f"expects {' or '.join(sorted(str(d) for d in allowed))} parameters: convert the model "
                "(model.float()) or enable the matching bf16/fp16 block"
            )


@dataclass(frozen=True)
class _Ctx:
    policy: DtypePolicy
    comm: Comm
    options: UnitOptions = field(default_factory=UnitOptions)

    @property
    def init_comm(self) -> Comm:
        return self.options.init_comm or self.comm


def build_units(
    model: nn.Module,
    rules: UnitRules,
    plan: StagePlan,
    policy: DtypePolicy,
    comm: Comm,
    options: UnitOptions | None = None,
) -> ModelUnits:
    check_dtypes(model, policy)
    ctx = _Ctx(policy, comm, options or UnitOptions())
    # Frozen parameters belong to no unit: they stay whole on every rank, at every stage. Those zero.Init
    # partitioned while they were still trainable (from_pretrained under ZeRO-3, then frozen by PEFT) get
    # their full values back here, in the model's parameter order on every rank.
    materialize([p for p in model.parameters() if not p.requires_grad], ctx.init_comm)
    if not plan.shard_parameters:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        units: list[FlatUnit] = []
        _bucket_units(units, named, rules.unit_elements, plan, ctx)
        return ModelUnits(units, [])
    return _stage3_units(model, rules, plan, ctx)


def _make(units: list[FlatUnit], named: Named, plan: StagePlan, ctx: _Ctx) -> FlatUnit:
    world = ctx.comm.world_size if plan.shard_optimizer else 1
    rank = ctx.comm.rank if plan.shard_optimizer else 0
    materialize([p for _, p in named], ctx.init_comm)  # zero.Init: full values for one unit at a time
    unit = FlatUnit(
        len(units),
        [p for _, p in named],
        [n for n, _ in named],
        rank=rank,
        world_size=world,
        plan=plan,
        policy=ctx.policy,
        master_device=ctx.options.master_device,
        pool=ctx.options.pool,
    )
    units.append(unit)
    if ctx.options.on_unit is not None:
        ctx.options.on_unit(unit)
    return unit


def _bucket_units(units: list[FlatUnit], named: Named, limit: int, plan: StagePlan, ctx: _Ctx) -> None:
    """Consecutive parameters in units of at most ``limit`` elements (one device each)."""
    current: Named = []
    size = 0
    for name, p in named:
        if current and (size + full_numel(p) > max(1, limit) or p.device != current[0][1].device):
            _make(units, current, plan, ctx)
            current, size = [], 0
        current.append((name, p))
        size += full_numel(p)
    if current:
        _make(units, current, plan, ctx)


def granularity_leaves(model: nn.Module, threshold: int, *, warn: bool = True) -> set[int]:
    """The modules (by ``id``) that ``stage3_module_granularity_threshold`` makes leaves: DeepSpeed's rule.

    A module's granularity is its parameter count (its subtree's, shared parameters counted once per use)
    over its number of layers (itself plus the parameterised modules below it); modules without children,
    without parameters, containers (``ModuleList``, ``Sequential``, ...) and modules of more than
    ``MAX_LEAF_ELEMENTS`` parameters have none. From the root down, the first module at or below the
    threshold on each path becomes a leaf: fewer, larger gathers for models of many small layers.
    """
    if threshold <= 0:
        return set()
    granularity: dict[int, int] = {}

    def walk(module: nn.Module) -> tuple[int, int]:  # (layers, parameters) of the subtree
        if next(module.parameters(), None) is None:
            return 0, 0
        params = sum(full_numel(p) for p in module.parameters(recurse=False))
        children = list(module.children())
        if not children:
            return 1, params
        layers = 0
        for child in children:
            child_layers, child_params = walk(child)
            layers, params = layers + child_layers, params + child_params
        if type(module).__name__ in containers.__all__:
            return layers, params
        layers += 1
        if params <= MAX_LEAF_ELEMENTS:
            granularity[id(module)] = params // layers
        return layers, params

    walk(model)
    leaves: set[int] = set()

    def mark(module: nn.Module) -> None:
        if granularity.get(id(module), sys.maxsize) <= threshold:
            leaves.add(id(module))
            return
        for child in module.children():
            mark(child)

    mark(model)
    if not leaves and warn:
        finest = min(granularity.values(), default=None)
        logger.warning(
            "zero_optimization.stage3_module_granularity_threshold %d makes no module a leaf: the finest "
            "module's granularity is %s; set the threshold at or above it",
            threshold,
            finest if finest is not None else "undefined (no module with children and parameters)",
        )
    return leaves


def _mark_configured_leaves(model: nn.Module, rules: UnitRules) -> None:
    """Mark every module ``zero_optimization.leaf_module`` names (by class, qualified class, name or name
    suffix) a leaf, as DeepSpeed's engine does at stage 3, so that ``z3_leaf_module`` reports it too."""
    for name, module in model.named_modules():
        cls = type(module)
        if (
            f"{cls.__module__}.{cls.__qualname__}" in rules.leaf_class_names
            or cls.__name__ in rules.leaf_class_names
            or (bool(name) and name in rules.leaf_names)
            or any(name.endswith(sfx) for sfx in rules.leaf_name_suffixes if name)
        ):
            set_leaf(module, True)


def _is_leaf(module: nn.Module, model: nn.Module) -> bool:
    return isinstance(module, leaf_classes(model)) or is_leaf(module)


def _stage3_units(model: nn.Module, rules: UnitRules, plan: StagePlan, ctx: _Ctx) -> ModelUnits:
    claimed: set[int] = set()
    owners: list[tuple[nn.Module, Named]] = []
    uses: list[tuple[nn.Module, list[nn.Parameter]]] = []
    leaves: list[str] = []
    by_granularity = granularity_leaves(model, rules.module_granularity_threshold, warn=ctx.comm.rank == 0)
    _mark_configured_leaves(model, rules)
    for name, module in model.named_modules():
        if any(leaf == "" or name.startswith(leaf + ".") for leaf in leaves):
            continue  # inside a leaf (the root itself may be one)
        leaf = id(module) in by_granularity or _is_leaf(module, model)
        if leaf:
            leaves.append(name)
        named = [(n, p) for n, p in module.named_parameters(prefix=name, recurse=leaf) if p.requires_grad]
        external = [p for p in external_parameters(module) if p.requires_grad]
        if named or external:
            uses.append((module, [p for _, p in named] + external))
        own = [(n, p) for n, p in named if id(p) not in claimed]
        claimed.update(id(p) for _, p in own)
        if own:
            owners.append((module, own))

    units: list[FlatUnit] = []
    unit_of: dict[int, FlatUnit] = {}
    persistent: Named = []
    persistent_plan = STAGES[2]  # full on every rank, gradients and optimizer state sharded

    def flush_persistent() -> None:
        if persistent:
            first = len(units)
            _bucket_units(units, persistent, rules.unit_elements, persistent_plan, ctx)
            for unit in units[first:]:
                unit_of.update({id(p): unit for p in unit.params})
            persistent.clear()

    for _, own in owners:
        if sum(full_numel(p) for _, p in own) <= rules.param_persistence_threshold:
            persistent.extend(own)
            continue
        flush_persistent()
        unit = _make(units, own, plan, ctx)
        unit_of.update({id(p): unit for p in unit.params})
    flush_persistent()

    module_units = []
    for module, params in uses:
        needed = unique_units(unit_of[id(p)] for p in params)
        needed = [u for u in needed if u.plan.shard_parameters]
        if needed:
            module_units.append((module, needed))
    return ModelUnits(units, module_units)
