"""Touching a sharded model from user code: ``GatheredParameters``, and ``Init`` to build a model partitioned.

The names follow ``deepspeed.zero`` so ported code keeps working: ``zeroshard.zero.GatheredParameters``,
``zeroshard.zero.register_external_parameter``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from zeroshard.core.comm import Comm
from zeroshard.core.ds_attrs import present, set_available
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.layout import FlatLayout
from zeroshard.core.liveness import NullMonitor
from zeroshard.core.owners import OwnerRegistry, ParameterMap
from zeroshard.core.partitioned import Partition, full_value, partition_entry, track
from zeroshard.core.stage3 import saved_views
from zeroshard.core.stage3.gatherer import ParameterGatherer
from zeroshard.core.stage3.module_marks import register_external_parameter
from zeroshard.dist import init_distributed
from zeroshard.offload.malloc import keep_large_blocks_mapped, release_free_memory
from zeroshard.watchdog import heartbeat

logger = logging.getLogger(__name__)

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]

_Owner = tuple[FlatUnit, "TrainedParameters"]  # the unit that holds a parameter, and its engine's map
# The parameter maps of the live engines ([Note: parameter owners] in core/owners.py).
_ENGINES: OwnerRegistry[_Owner] = OwnerRegistry(weak=True)


class TrainedParameters:
    """The parameters one engine trains, each with the unit that holds it, the engine's gatherer and group.

    The engine and its model's state-dict hooks hold it, so it lives as long as either; ``GatheredParameters``
    and ``safe_get_full_*`` find it from a parameter ([Note: parameter owners] in core/owners.py). ``shard``
    is the group the units' shards span (``comm``, or hybrid sharding's shard group); ``optimizer`` and
    ``slices`` (this rank's pieces of each parameter, as the optimizer steps them) serve
    ``safe_get_full_optimizer_state``.
    """

    def __init__(
        self,
        units: Sequence[FlatUnit],
        gatherer: ParameterGatherer | None,
        comm: Comm,
        *,
        shard: Comm | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        slices: Sequence[OptimizerSlice] = (),
    ) -> None:
        self.units = list(units)
        self.gatherer = gatherer
        self.comm = comm
        self.shard = shard or comm
        self.optimizer = optimizer
        self.slices: dict[int, list[OptimizerSlice]] = {}
        for sl in slices:
            self.slices.setdefault(id(sl.param), []).append(sl)
        self.owners: ParameterMap[_Owner] = ParameterMap()
        for unit in self.units:
            for param in unit.params:
                self.owners[param] = (unit, self)
        _ENGINES.add(self.owners)


def owner_of(param: nn.Parameter) -> _Owner | None:
    """The unit holding ``param`` in the newest engine that trains it, with that engine's map, or ``None``."""
    return _ENGINES.find(param)


class GatheredParameters:
    """Gather ``params`` for the block; with ``modifier_rank``, keep that rank's in-place changes.

    Works on the parameters of a trained engine and on those ``Init`` still keeps partitioned (before
    ``initialize``).

    Inside the block the parameters are full on every rank (at stages 0-2 they always are), and those that
    show DeepSpeed's attributes say ``ds_status`` ``AVAILABLE``; after it, ``NOT_AVAILABLE`` again where
    they are sharded ([Note: DeepSpeed parameter attributes] in core/ds_attrs.py). On exit, when
    ``modifier_rank`` is given, that rank's values are broadcast to every rank and written into the master
    shards the optimizer steps, then stage-3 parameters are released again. Nested use is fine.

    Collective: enter and leave on all ranks with the same parameters.
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        plist: list[nn.Parameter] = [params] if isinstance(params, nn.Parameter) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        owners = [(p, owner_of(p)) for p in plist]
        self._owned = [owner for _, owner in owners if owner is not None]
        # An engine's stage-3 parameters: ds_status AVAILABLE inside the block only, where saving one for
        # backward keeps the parameter ([Note: DeepSpeed parameter attributes] in core/ds_attrs.py).
        self._held = [p for p, o in owners if o is not None and _gatherer_of(*o) is not None]
        # Parameters still partitioned by Init (before initialize: how from_pretrained fills a model).
        self._partitioned = [p for p in plist if partition_entry(p) is not None]
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        comms = [e[2] for e in map(partition_entry, self._partitioned) if e is not None]
        keep = self.modifier_rank is not None
        comms += [t.comm for unit, t in self._owned if keep or _gatherer_of(unit, t) is not None]
        reporting = [*comms, *(trained.comm for _, trained in self._owned)]
        monitor = reporting[0].monitor if reporting else NullMonitor()
        self._stack.enter_context(monitor.api("GatheredParameters"))
        try:
            if comms:  # something to communicate: every rank must be here (see Comm.check_entry)
                comms[0].check_entry("GatheredParameters", None)
        except BaseException:
            self._stack.close()
            raise
        for param in self._partitioned:
            shape, shard, comm = partition_entry(param) or _missing(param)
            # A shard in CPU memory (remote_device="cpu") is gathered where the group communicates.
            device = comm.device if shard.device.type == "cpu" else shard.device
            param.data = full_value(shape, shard, comm, device)
        set_available(self._partitioned, True)
        by_gatherer: dict[int, tuple[ParameterGatherer, list[FlatUnit]]] = {}
        for unit, trained in self._owned:
            if (gatherer := _gatherer_of(unit, trained)) is not None:
                by_gatherer.setdefault(id(gatherer), (gatherer, []))[1].append(unit)
        for gatherer, units in by_gatherer.values():
            self._stack.enter_context(gatherer.hold(units))
        if by_gatherer:
            # Saves inside the block keep the parameter objects (see [Note: saved views]).
            self._stack.enter_context(saved_views.suspended())
        set_available(self._held, True)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.enabled:
            self._repartition(keep=self.modifier_rank is not None and kind is None)
        try:
            if self.enabled and self.modifier_rank is not None and kind is None:
                units = {id(u): (u, trained.comm) for u, trained in self._owned}
                for unit, comm in sorted(units.values(), key=lambda uc: uc[0].index):
                    comm.broadcast(
                        unit.full, src=self.modifier_rank, what="GatheredParameters broadcast"
                    ).wait()
                    unit.full_to_master()
        finally:
            if self.enabled:
                set_available(self._held, False)  # before the release: never AVAILABLE while empty
            self._stack.close()

    def _repartition(self, keep: bool) -> None:
        """Cut the ``Init``-partitioned parameters back to their shards, with the modifier's values if
        ``keep`` (broadcast first), else with the values they had (changes are discarded, as DeepSpeed does).
        Collective: all ranks."""
        for param in self._partitioned:
            _, shard, comm = partition_entry(param) or _missing(param)
            if keep:
                value = param.detach().contiguous()
                comm.broadcast(value, src=self.modifier_rank or 0, what="GatheredParameters broadcast").wait()
                param.data = value
                _cut(param, shard, comm)
            else:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        set_available(self._partitioned, False)


def _gatherer_of(unit: FlatUnit, trained: TrainedParameters) -> ParameterGatherer | None:
    """The gatherer that gathers ``unit``'s parameters for use (stage 3: empty between uses), or None."""
    return trained.gatherer if unit.plan.shard_parameters else None


def _missing(param: nn.Parameter) -> tuple[torch.Size, torch.Tensor, Comm]:
    raise RuntimeError(
        f"a parameter of shape {tuple(param.shape)} left zero.Init's partitioning while gathered"
    )


# -- building a model already partitioned -----------------------------------------------------------------
# Init's partitioned parameters are listed in core/partitioned.py ([Note: parameter owners]).


class Init:
    """Build a model partitioned: each submodule's parameters are cut to this rank's slice as soon as the
    submodule is attached to its parent, so the whole model never exists on one rank.

    Every rank builds each submodule in full (with the same seed every rank gets the same values, equal to
    building the whole model in one process) and keeps 1/W of it; the full values exist for one submodule
    at a time. ``initialize`` then gathers one unit at a time to lay out the shards it trains. Parameters
    of modules never attached to a parent (the outermost model's own, a module built on its own) are cut
    when the block ends. Parameters already frozen when their submodule is attached are not partitioned
    (zeroshard keeps frozen parameters whole) and show DeepSpeed's attributes only after ``initialize``.

    To change parameters once their submodule is attached (loading a checkpoint, a custom init), do it inside
    ``GatheredParameters(params, modifier_rank=0)``, before or after ``initialize``: the parameters are full
    inside the block and rank 0's values become every rank's shards on exit (what Hugging Face does under
    ZeRO-3). Outside such a block they are empty placeholders, and writes to them are lost, as in DeepSpeed.

    ``partitioned`` maps each parameter this context cut to its full shape and shard until ``initialize``
    takes it ([Note: parameter owners] in core/owners.py). Each cut parameter also shows DeepSpeed's
    placeholder attributes at once: ``ds_shape``, ``ds_numel``, ``ds_id``, ``ds_status`` (``NOT_AVAILABLE``,
    ``AVAILABLE`` inside ``GatheredParameters``), ``ds_tensor`` (this rank's shard: ``ceil(numel / W)``
    elements of the parameter's dtype, rank ``r`` holding elements ``[r * size, (r + 1) * size)``, zero
    padded) and ``partition_numel()``. They mirror the map's entry and own nothing ([Note: DeepSpeed
    parameter attributes] in core/ds_attrs.py).

    With ``module`` (DeepSpeed's ``zero.Init(module=model)``) the parameters of an already built model are
    partitioned at once, its own included; the context need not be entered then.

    With ``remote_device="cpu"`` the shards live in CPU memory wherever the model is built (a model built on
    the GPU then never stays there whole); a gather brings a parameter to the group's device. Train such a
    model with ``offload_param: {"device": "cpu"}`` to keep its shards in CPU memory afterwards.

    Collective in effect: every rank must build the same model. ``config`` and the other DeepSpeed keyword
    arguments are accepted for compatibility; ``enabled=False`` builds the model normally.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        if module is not None and not isinstance(module, nn.Module):
            raise TypeError(f"zero.Init(module=...) takes an nn.Module, got {type(module).__name__}")
        # DeepSpeed's remaining arguments change nothing here (zeroshard swaps no tensor constructor and
        # partitions over the data-parallel group only); the ones that would ask for a missing feature say so.
        unsupported = {
            "mpu": mpu,
            "zero_param_parallel_group": zero_param_parallel_group,
            "sequence_data_parallel_group": sequence_data_parallel_group,
            "param_swapper": param_swapper,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"zero.Init({name}=...) is not supported by zeroshard (data parallel only)")
        if zero_quantized_nontrainable_weights:
            raise ValueError(
                "zero.Init(zero_quantized_nontrainable_weights=...) (ZeRO++ quantized storage of frozen "
                "weights) is not supported"
            )
        # zero_quantized_weights: the engine's gathers follow the config's zero_quantized_weights.
        self.enabled = enabled
        self.dtype = dtype
        if enabled and data_parallel_group is None:
            # As DeepSpeed's Init: join the process group the launcher describes (a no-op without one, or
            # when one exists), so that a model built before initialize() is partitioned over it.
            init_distributed()
        self.comm = Comm(data_parallel_group, monitor=heartbeat.monitor_for_world())
        self._handle: Any = None
        # This context's partitioned parameters; listed (track) until initialize() takes them all.
        self.partitioned: ParameterMap[Partition] = ParameterMap()
        self._api: Any = None
        # Building a model that will train with NVMe offload: keep the allocator from hoarding the full
        # submodules built here (see offload/malloc.py).
        self._offloading = remote_device == "nvme" or _offloads_to_nvme(config_dict_or_path or config)
        # remote_device="cpu": the shards live in CPU memory, wherever the model is built (DeepSpeed's Init).
        self._shard_device = torch.device("cpu") if remote_device == "cpu" else None
        if module is not None and enabled:
            for param in module.parameters():
                if partition_entry(param) is None and param.requires_grad:
                    self._partition(param)

    def __enter__(self) -> Init:
        if self.enabled:
            heartbeat.start(self.comm)  # see [Note: liveness] in watchdog/monitor.py
            self._api = self.comm.monitor.api("zero.Init")
            self._api.__enter__()  # left in __exit__
            if self._offloading:
                keep_large_blocks_mapped()
            register = nn.modules.module.register_module_module_registration_hook
            self._handle = register(self._on_child)
            self._built: list[tuple[weakref.ref[nn.Module], str]] = []
            watch = nn.modules.module.register_module_parameter_registration_hook
            self._param_handle = watch(self._on_parameter)
            self._plain_apply = nn.Module.apply
            nn.Module.apply = _gathering_apply(self._plain_apply)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._api is not None:
            self._api.__exit__()
            self._api = None
        if self._handle is not None:
            self._handle.remove()
            self._param_handle.remove()
            self._handle = None
            nn.Module.apply = self._plain_apply  # type: ignore[method-assign]
            if exc[0] is None:
                self._partition_unattached()
            release_free_memory()

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            self._built.append((weakref.ref(module), name))

    def _partition_unattached(self) -> None:
        """Partition the parameters built in the block that no attachment partitioned: those of modules
        never attached to a parent (the outermost model's own, a module built on its own), as DeepSpeed's
        Init partitions every module at the end of its constructor. In the order they were built."""
        for ref, name in self._built:
            module = ref()
            param = module._parameters.get(name) if module is not None else None
            if param is not None and partition_entry(param) is None and param.requires_grad:
                self._partition(param)
        self._built = []

    def _on_child(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        if child is None:
            return
        for param in child.parameters(recurse=False):
            if partition_entry(param) is None and param.requires_grad:
                self._partition(param)

    def _partition(self, param: nn.Parameter) -> None:
        if self.dtype is not None and param.is_floating_point():
            param.data = param.data.to(self.dtype)
        layout = FlatLayout.for_shapes([param.numel()], self.comm.world_size)
        shard = torch.zeros(layout.shard_size, dtype=param.dtype, device=self._shard_device or param.device)
        shape = param.shape
        self.partitioned[param] = (shape, shard, self.comm)
        track(self.partitioned)
        _cut(param, shard, self.comm)
        present(param, shape, shard, available=False)  # ds_tensor is the shard itself


def _gathering_apply(plain: Any) -> Any:
    """``nn.Module.apply`` while ``Init`` is active: ``fn`` sees each module's partitioned parameters full,
    and rank 0's values become every rank's shards afterwards (what ``GatheredParameters(...,
    modifier_rank=0)`` does). A model that calls ``self.apply(self._init_weights)`` at the end of its
    ``__init__`` (nanoGPT, many others), after its submodules were partitioned, is initialised as it is
    without ``Init``; DeepSpeed's ``Init`` does the same. Collective: every rank builds the same model."""

    def apply(module: nn.Module, fn: Any) -> nn.Module:
        if getattr(fn, "_zeroshard_gathers", False):
            return plain(module, fn)  # type: ignore[no-any-return]

        def gathered(m: nn.Module) -> None:
            params = [p for p in m.parameters(recurse=False) if partition_entry(p) is not None]
            if not params:
                fn(m)
                return
            with GatheredParameters(params, modifier_rank=0):
                fn(m)

        gathered._zeroshard_gathers = True  # type: ignore[attr-defined]
        return plain(module, gathered)  # type: ignore[no-any-return]

    return apply


def _cut(param: nn.Parameter, shard: torch.Tensor, comm: Comm) -> None:
    """Copy this rank's slice of ``param``'s full value into ``shard`` and leave a placeholder behind."""
    lo = comm.rank * shard.numel()
    flat = param.detach().reshape(-1)
    end = min(lo + shard.numel(), flat.numel())
    if end > lo:
        shard[: end - lo].copy_(flat[lo:end])
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _offloads_to_nvme(config: Any) -> bool:
    """Whether a ds_config (dict or JSON path) puts parameters or optimizer state on NVMe."""
    if isinstance(config, (str, os.PathLike)) and os.path.isfile(config):
        with open(config) as f:
            config = json.load(f)
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    blocks = (zero.get("offload_param"), zero.get("offload_optimizer")) if isinstance(zero, dict) else ()
    return any(isinstance(b, dict) and b.get("device") == "nvme" for b in blocks)
