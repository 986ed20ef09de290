"""Model state off the accelerator and back: ``engine.offload_states()`` and ``engine.reload_states()``.

[Note: moving states]
Between two steps (or two micro-steps) a rank may lend its accelerator memory to something else, an
inference engine generating rollouts in RLHF for instance, and take the model state back before it trains
again. What moves is what lives on the device the model computes on (the *compute device*), by kind, with
DeepSpeed's names (``OffloadStateTypeEnum``):

* ``optim_states``: the optimizer's state tensors (Adam's moments);
* ``hp_params``: the masters, and the optimizer's slices of them ([Note: optimizer over slices]);
* ``lp_params``: the parameters in the compute dtype: each unit's full buffer, which the module's
  parameters are views of, at stages 0-2 (and for stage 3's persistent units). A stage-3 unit keeps no
  parameter shard besides its master between uses (its gathers read the master), so there
  ``lp_params`` moves the master, as ``hp_params`` does;
* ``lp_grads``: the gradient accumulators: the full flat gradient (stages 0-1), the shard where one is
  held (stages 2-3, between micro-steps), a ``param.grad`` left by ``loss.backward()``;
* ``contiguous_grad_buffer``: the communication buffers the pool keeps idle: dropped, not moved; the next
  backward allocates them again.

State that is elsewhere already (masters and optimizer state in CPU memory under ``offload_optimizer``)
stays where it is, as DeepSpeed leaves it. Frozen parameters and the module's buffers are not model state
of the engine's and stay too.

How: every tensor the engine and the optimizer hold is grouped by the storage it lives in, and a storage
that holds state of a requested kind is copied, whole, to the target device; then every one of those
tensors on it is re-pointed into the copy (``tensor.data = ...``, same offset, shape and strides). Tensor
objects keep their identity, so the optimizer's param groups and state (keyed by the master slices), the
engine's step and the user's references to parameters all stay valid, and aliases survive: parameters
stay views of the full buffer, slices views of the master, and fp32's master at stages 0-2 (the full
buffer's own shard) moves with the full buffer whichever of the two kinds asked for it. The old storage
is freed when its last tensor is re-pointed. Reload copies each storage back to the compute device and
re-points the same tensors, so a round trip gives back the same bits and training after it is
bit-identical to never offloading. Nothing is communicated: each rank moves its own state.

On a CPU-only machine the compute device is the CPU: the storages are still copied to new CPU memory and
back (so the mechanism is the one a GPU run takes), which frees nothing and costs one copy each way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zeroshard.core.flat_param import FlatUnit

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum", "StateOffload", "require_offloadable"]

logger = logging.getLogger(__name__)


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state goes (DeepSpeed's members and values)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of state ``offload_states(include=...)`` names (DeepSpeed's members and values); what
    each is here: [Note: moving states]."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def require_offloadable(
    what: str, stage: int, optimizer: torch.optim.Optimizer | None, offload_param_device: str = "none"
) -> torch.optim.Optimizer:
    """The engine's optimizer, if ``what`` (``offload_states``/``reload_states``) may run on this engine
    (``offload_param_device``: the config's ``zero_optimization.offload_param.device``, which only
    ``offload_states`` checks).

    Raises:
        AttributeError: ZeRO stage 0, where DeepSpeed 0.19's engine has no ZeRO optimizer to move state
            with and fails the same way.
        RuntimeError: the engine has no optimizer (DeepSpeed refuses that too).
        ValueError: ``zero_optimization.offload_param`` is on (DeepSpeed refuses that too).
    """
    if stage == 0:
        raise AttributeError(
            f"engine.{what}() needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0): DeepSpeed 0.19 "
            "moves state only through its ZeRO optimizers"
        )
    if optimizer is None:
        raise RuntimeError(f"engine.{what}() needs an optimizer: this engine was built without one")
    if offload_param_device != OffloadDeviceEnum.none.value:
        raise ValueError(
            f"engine.{what}() with zero_optimization.offload_param.device={offload_param_device!r}: the "
            "parameters are offloaded already and cannot be moved as well (allowed: 'none')"
        )
    return optimizer


def requested_kinds(include: Iterable[OffloadStateTypeEnum | str] | None) -> list[OffloadStateTypeEnum]:
    """``include`` as kinds, in ``OffloadStateTypeEnum``'s order (``None``: every kind).

    Raises:
        TypeError: ``include`` is a single string (a container of kinds is expected).
        ValueError: an entry that names no kind.
    """
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, str):
        raise TypeError(
            f"offload_states(include={include!r}): expected a container of OffloadStateTypeEnum members, "
            f"e.g. [{include!r}]"
        )
    wanted: set[OffloadStateTypeEnum] = set()
    for item in include:
        try:
            wanted.add(OffloadStateTypeEnum(item))
        except ValueError:
            allowed = ", ".join(repr(k.value) for k in OffloadStateTypeEnum)
            raise ValueError(
                f"offload_states(include=...): {item!r} is no state kind; allowed: {allowed}"
            ) from None
    return [k for k in OffloadStateTypeEnum if k in wanted]


def target_device(device: OffloadDeviceEnum | str) -> torch.device | None:
    """The torch device ``offload_states(device=...)`` moves to; None for ``none`` (nothing to do).

    Raises:
        ValueError: ``nvme`` (DeepSpeed refuses it too) or a value that is no ``OffloadDeviceEnum``.
    """
    try:
        kind = OffloadDeviceEnum(device)
    except ValueError:
        allowed = ", ".join(repr(d.value) for d in OffloadDeviceEnum)
        raise ValueError(f"offload_states(device={device!r}): allowed: {allowed}") from None
    if kind is OffloadDeviceEnum.nvme:
        raise ValueError("offload_states(device='nvme'): state moves to CPU memory only; allowed: 'cpu'")
    if kind is OffloadDeviceEnum.none:
        return None
    return torch.device("cpu")


@dataclass
class _Moved:
    """One storage moved off the compute device: the copy (bytes), where it came from, and the tensors
    that were re-pointed into it."""

    copy: torch.Tensor
    home: torch.device
    users: list[torch.Tensor]


class StateOffload:
    """What ``offload_states`` moved, so that ``reload_states`` moves it back ([Note: moving states]).

    Invariants: ``kinds`` holds the kinds offloaded and not reloaded since; each moved storage's copy
    lives off the compute device, and every tensor re-pointed into it still points there unless the
    engine gave that tensor new memory since (reload then leaves that tensor alone).
    """

    def __init__(self) -> None:
        self.kinds: set[OffloadStateTypeEnum] = set()
        self._moved: list[_Moved] = []

    def offload(
        self,
        units: Sequence[FlatUnit],
        optimizer: torch.optim.Optimizer,
        *,
        include: Iterable[OffloadStateTypeEnum | str] | None,
        device: OffloadDeviceEnum | str,
        pin_memory: bool,
        non_blocking: bool,
    ) -> None:
        """Move the requested kinds not offloaded already from the compute device to ``device``.

        ``pin_memory``: copies from an accelerator go to page-locked memory (fast, asynchronous reload).
        ``non_blocking``: the copies may still run on the current stream when this returns. Local: no
        communication.
        """
        kinds = [k for k in requested_kinds(include) if k not in self.kinds]
        target = target_device(device)
        _check_flag("pin_memory", pin_memory)
        _check_flag("non_blocking", non_blocking)
        if target is None:
            logger.warning("offload_states(device='none'): no device to move to, nothing moved")
            return
        if not units:
            self.kinds.update(kinds)
            return
        home = units[0].device
        by_kind = _state_tensors(units, optimizer)
        users = _by_storage(t for tensors in by_kind.values() for t in tensors if t.device == home)
        for key in dict.fromkeys(_storage(t) for k in kinds for t in by_kind[k] if t.device == home):
            if key in users:
                self._moved.append(_move(users[key], target, pin_memory, non_blocking))
        if OffloadStateTypeEnum.contiguous_grad_buffer in kinds:
            for pool in {id(u.pool): u.pool for u in units if u.pool is not None}.values():
                pool.clear()
        self.kinds.update(kinds)
        _settle(home, wait=not non_blocking)

    def reload(self, *, non_blocking: bool) -> None:
        """Move everything :meth:`offload` moved back to the compute device; returns once the copies are
        done (``non_blocking`` lets them overlap each other). Local: no communication."""
        _check_flag("non_blocking", non_blocking)
        for moved in self._moved:
            current = [t for t in moved.users if _storage(t) == _storage(moved.copy)]
            back = torch.empty_like(moved.copy, device=moved.home)
            back.copy_(moved.copy, non_blocking=non_blocking)
            for tensor in current:
                _repoint(tensor, back)
        for home in {moved.home for moved in self._moved}:
            _settle(home, wait=True)  # before the copies' sources are let go
        self._moved.clear()
        self.kinds.clear()


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected True or False")


def _state_tensors(
    units: Sequence[FlatUnit], optimizer: torch.optim.Optimizer
) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """Every tensor of the engine's model state, by kind ([Note: moving states]); a tensor may be listed
    under two kinds (stage 3's master), and tensors of different kinds may share a storage.

    Raises:
        RuntimeError: a stage-3 unit is gathered (inside ``GatheredParameters`` or a forward).
    """
    by_kind: dict[OffloadStateTypeEnum, list[torch.Tensor]] = {k: [] for k in OffloadStateTypeEnum}
    for unit in units:
        if unit.plan.shard_parameters:
            if unit.gathered and unit.layout.padded:
                raise RuntimeError(
                    f"offload_states(): unit {unit.index} ({unit.names[0]}, ...) is gathered; call it "
                    "between steps, outside GatheredParameters / gathered_parameters()"
                )
            by_kind[OffloadStateTypeEnum.lp_params].append(unit.master)  # what its gathers read
        else:
            by_kind[OffloadStateTypeEnum.lp_params] += [unit.full, *unit.params]
        by_kind[OffloadStateTypeEnum.hp_params].append(unit.master)
        grads = by_kind[OffloadStateTypeEnum.lp_grads]
        if unit.grad_full is not None:
            grads.append(unit.grad_full)
        if unit.holds_grad_shard:
            grads.append(unit.grad_shard)
        grads += [p.grad for p in unit.params if p.grad is not None]
    for group in optimizer.param_groups:
        by_kind[OffloadStateTypeEnum.hp_params] += list(group["params"])  # the master slices
    for state in optimizer.state.values():
        by_kind[OffloadStateTypeEnum.optim_states] += [
            v for v in state.values() if isinstance(v, torch.Tensor)
        ]
    return by_kind


def _storage(tensor: torch.Tensor) -> tuple[torch.device, int]:
    """Which memory ``tensor`` lives in (its storage's device and address)."""
    return tensor.device, tensor.untyped_storage().data_ptr()


def _by_storage(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.device, int], list[torch.Tensor]]:
    """The tensors (each object once) grouped by storage; empty storages left out."""
    out: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) in seen or tensor.untyped_storage().nbytes() == 0:
            continue
        seen.add(id(tensor))
        out.setdefault(_storage(tensor), []).append(tensor)
    return out


def _move(users: list[torch.Tensor], target: torch.device, pin_memory: bool, non_blocking: bool) -> _Moved:
    """Copy the storage ``users`` share to ``target`` and re-point each of them into the copy."""
    storage = users[0].untyped_storage()
    source = torch.empty(0, dtype=torch.uint8, device=users[0].device).set_(storage)
    pin = pin_memory and target.type == "cpu" and source.device.type != "cpu"
    copy = torch.empty(source.numel(), dtype=torch.uint8, device=target, pin_memory=pin)
    copy.copy_(source, non_blocking=non_blocking)
    for tensor in users:
        _repoint(tensor, copy)
    return _Moved(copy=copy, home=source.device, users=users)


def _repoint(tensor: torch.Tensor, storage_bytes: torch.Tensor) -> None:
    """Make ``tensor`` a view of ``storage_bytes``'s storage at its own offset, shape and strides."""
    view = torch.empty(0, dtype=tensor.dtype, device=storage_bytes.device)
    view.set_(storage_bytes.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    tensor.data = view


def _settle(device: torch.device, wait: bool) -> None:
    """On a GPU: wait for the copies if asked, and give the freed blocks back to the driver."""
    if device.type != "cuda":
        return
    if wait:
        torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
