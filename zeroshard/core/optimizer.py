"""The sharded optimizer step: build groups over shards, clip, step, all-gather the updated shards.

[Note: optimizer over slices]
The torch optimizer never sees the model's parameters. It sees, per parameter, the 1-D slice of this rank's
master shard that belongs to it (see ``flat_param.OptimizerSlice``), in the same param group as the
parameter. Every elementwise optimizer (Adam, AdamW, SGD, Adagrad, ...) then computes exactly what it would
on the whole parameter, each slice keeps its own state and step count, and a slice whose parameter got no
gradient anywhere gets ``grad = None`` and is skipped exactly as torch skips it: no weight decay drift on
unused parameters. Because the groups hold the slices, a scheduler or a user editing
``optimizer.param_groups`` edits what the shards are stepped with.

[Note: DeepSpeed's fp32 clipping]
Without ZeRO (stage 0) and in fp32, DeepSpeed's engine clips with its ``runtime.utils.clip_grad_norm_``:
one fp32 norm per parameter (zero for one without a gradient: its reduction filled it with zeros), in
registration order; their squares summed in fp32 and the square root taken in fp32; that norm divided by
the world size and all-reduced, which gives it back (every rank holds the same reduced gradients); then
every gradient multiplied by ``min(1, clip / (norm + 1e-6))``, computed in fp32. Every step here where
every rank holds every reduced gradient in fp32 (stage 0 in fp32) computes its norm and clip factor the
same way, so they are DeepSpeed's to the bit. The float64 sum used elsewhere is more accurate, but
differs from DeepSpeed's by an ulp now and then, and Adam can amplify an ulp of one step's clip factor: in
a DCGAN with client ``torch.optim.Adam`` optimizers (tests/ds_scripts/train_gan_adam.py) the losses moved
off DeepSpeed's by 2e-7 within 3 steps and by 2e-5 (W=2) and 1e-2 (W=1) at step 20. Where the step
shards the optimizer, DeepSpeed's ZeRO optimizer computes its norm in yet other ways; that path keeps the
float64 sum.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from zeroshard.core.comm import Comm, Pending
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.slice_norms import piece_norms, slices_by_unit
from zeroshard.core.stages import StagePlan


class OffloadedStep(Protocol):
    """Steps the optimizer over masters and state that live outside device memory, one sub-group at a
    time, and writes the stepped masters into the parameters (``FlatUnit.master_to_full``) as it goes.

    ``offload.swapper.OptimizerStateSwapper`` (``offload_optimizer`` nvme) and ``offload.host_step.HostStep``
    (``offload_optimizer`` cpu beside a GPU) implement it; this step only hands them the gradients.
    """

    def step(self, grads: dict[int, torch.Tensor | None], factor: float = 1.0) -> None:
        """Step every slice with ``grads`` (keyed by ``id`` of a slice's master; None or absent skips),
        each gradient multiplied by ``factor`` (unscale and clip) as its slice is stepped."""
        ...

    def grad_partials(self, unit: FlatUnit) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fp32 norms of ``unit``'s optimizer pieces (slice order, empty pieces left out) and whether its
        gradient shard is finite, taken earlier and still current; None to read the shard instead."""
        ...


def normalize_param_groups(model: nn.Module, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Turn ``model_parameters`` (params, named params or group dicts) into group dicts of the model's params.

    Raises:
        ValueError: a parameter that is not one of the model's, or one listed twice.
    """
    if params is None:
        raw: list[Any] = [{"params": list(model.parameters())}]
    else:
        items = list(params)
        if items and isinstance(items[0], Mapping):
            raw = [dict(g) for g in items]
        else:
            raw = [{"params": items}]
    owned = {id(p): name for name, p in model.named_parameters()}
    seen: set[int] = set()
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(raw):
        plist = group["params"]
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        plist = [p[1] if isinstance(p, tuple) else p for p in plist]
        for p in plist:
            if id(p) not in owned:
                raise ValueError(
                    f"model_parameters group {gi}: a tensor of shape {tuple(p.shape)} is not a parameter of "
                    "the model given to initialize(); pass model.parameters() or groups built from them"
                )
            if id(p) in seen:
                raise ValueError(
                    f"model_parameters: parameter {owned[id(p)]!r} appears in more than one group"
                )
            seen.add(id(p))
        groups.append({**group, "params": plist})
    return groups


def shard_param_groups(
    groups: Sequence[Mapping[str, Any]], units: Sequence[FlatUnit]
) -> tuple[list[dict[str, Any]], list[OptimizerSlice]]:
    """Replace each group's parameters by this rank's slices of them (see [Note: optimizer over slices]).

    Trainable parameters that no group names are left out of the optimizer (they keep their values), as a
    torch optimizer would leave them.
    """
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    sharded = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
    slices: list[OptimizerSlice] = []
    for unit in units:
        for sl in unit.optimizer_slices():
            gi = group_of.get(id(sl.param))
            if gi is None:
                continue
            sharded[gi]["params"].append(sl.master)
            slices.append(sl)
    return sharded, slices


def reseat_optimizer(optimizer: torch.optim.Optimizer, sharded_groups: Sequence[dict[str, Any]]) -> None:
    """Point a client optimizer's groups at the shard slices, keeping its class and hyperparameters.

    The groups stay the same dict objects, so a scheduler already built on this optimizer keeps working.
    """
    if len(optimizer.param_groups) != len(sharded_groups):
        raise ValueError(
            f"the client optimizer has {len(optimizer.param_groups)} param groups but {len(sharded_groups)} "
            "were derived from it"
        )
    for group, sharded in zip(optimizer.param_groups, sharded_groups, strict=True):
        group["params"] = sharded["params"]
    optimizer.state.clear()


@dataclass(frozen=True)
class StepChecks:
    """What every rank must agree on before an optimizer step, all from one all-reduce of a few numbers.

    Attributes:
        nonfinite: some rank's reduced gradients hold inf or NaN (always False when not checked).
        grad_norm: the global L2 norm of the reduced gradients (still multiplied by any loss scale).
        has_grad: per parameter of every unit (in unit order), whether any rank produced a gradient for it
            since the last zero (``GradientReducer.local_has_grad``'s layout).
    """

    nonfinite: bool
    grad_norm: float
    has_grad: torch.Tensor


class ShardedStep:
    """Turns reduced gradient shards into the optimizer's gradients and runs the post-step gather.

    The overflow check and the gradient norm read the reduced shards where they are (device and dtype);
    the unscale/clip factor is only recorded (:meth:`scale_grads`). :meth:`run` then gives the optimizer
    fp32 gradients on the master's device with the factor applied: a transient fp32 copy where a shard is
    16-bit, or per sub-group inside an offloaded step (``OffloadedStep``: masters in CPU memory beside a
    GPU, or on NVMe). The values are the same on every path.

    Collective: :meth:`checks` (the overflow flag, the gradient norm and which parameters got a gradient,
    fused into one all-reduce) and :meth:`gather_params` must be called on all ranks.
    """

    def __init__(
        self,
        units: Sequence[FlatUnit],
        slices: Sequence[OptimizerSlice],
        comm: Comm,
        plan: StagePlan,
        allgather_bucket_size: int = 500_000_000,
        swapper: OffloadedStep | None = None,
        replica: Comm | None = None,
    ) -> None:
        self.allgather_bucket_size = allgather_bucket_size
        # Hybrid sharding: the ranks holding the same shards ([Note: hybrid sharding] in hybrid.py).
        self.replica = replica
        self.swapper = swapper
        self.stepping = False  # inside run(): the only place the client optimizer may step
        self.units = list(units)
        self.slices = list(slices)
        self.comm = comm
        self.plan = plan
        # Every rank holds every reduced fp32 gradient: norm and clip factor as DeepSpeed's stage 0 computes
        # them ([Note: DeepSpeed's fp32 clipping]).
        self.fp32_clipping = not plan.shard_optimizer and all(
            u.policy.compute == torch.float32 for u in self.units
        )
        self._grads: dict[int, torch.Tensor] = {}
        self._slice_grads: dict[int, torch.Tensor | None] = {}
        self._factor = 1.0  # pending gradient scale: unscale and clip, applied by run()
        self._masters_written = False  # run() by an offloaded step, which wrote the parameters itself
        # Where each unit's parameters start in the flat has_grad flags (units in order, one flag each).
        self._first_flag: dict[int, int] = {}
        self._unit_slices = slices_by_unit(self.slices)
        offset = 0
        for unit in self.units:
            self._first_flag[unit.index] = offset
            offset += len(unit.params)

    def prepare(self) -> None:
        """Take each unit's reduced gradient shard, as it is, for the checks, the norm and the step (one
        still being copied to CPU memory is waited for only where its values are read: :meth:`_landed`)."""
        self._factor = 1.0
        self._grads = {u.index: u.peek_grad_shard() for u in self.units}

    def _landed(self, unit: FlatUnit) -> torch.Tensor:
        """``unit``'s gradient shard as :meth:`prepare` took it, once a copy bringing it in has landed."""
        unit.grad_shard  # noqa: B018  (waits for a copy bringing the shard in: FlatUnit.move_grad_shard)
        return self._grads[unit.index]

    def _partials(self, unit: FlatUnit) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.swapper is None else self.swapper.grad_partials(unit)

    def release(self) -> None:
        for sl in self.slices:
            sl.master.grad = None
        self._grads = {}
        self._slice_grads = {}

    def attach_grads(self, has_grad: torch.Tensor) -> None:
        """Record each slice's gradient (a view of the reduced shard), or None where no rank produced one.

        ``has_grad`` holds one flag per parameter of every unit, in unit order (``StepChecks.has_grad``).
        :meth:`run` hands the gradients to the optimizer (or the NVMe swapper, one sub-group at a time).
        """
        flags = has_grad.tolist()  # one conversion, not one tensor read per slice
        for sl in self.slices:
            used = flags[self._first_flag[sl.unit.index] + sl.piece.index]
            start = sl.piece.shard_start
            grad = self._grads[sl.unit.index][start : start + sl.piece.numel] if used else None
            self._slice_grads[id(sl.master)] = grad

    def run(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step over the attached gradients: one call, or one per offloaded sub-group."""
        self.stepping = True
        try:
            if self.swapper is not None:
                self.swapper.step(self._slice_grads, self._factor)
                self._masters_written = True
                return
            step_grads = self._step_grads()
            for sl in self.slices:
                if self._slice_grads[id(sl.master)] is not None:
                    start = sl.piece.shard_start
                    sl.master.grad = step_grads[sl.unit.index][start : start + sl.piece.numel]
            optimizer.step()
        finally:
            self.stepping = False

    def _step_grads(self) -> dict[int, torch.Tensor]:
        """Each unit's gradient shard in its master's dtype and on its device, times the pending factor."""
        out: dict[int, torch.Tensor] = {}
        for unit in self.units:
            out[unit.index] = unit.grad_shard.to(device=unit.master.device, dtype=unit.master.dtype)
        if self._factor != 1.0:
            for grad in out.values():
                grad.mul_(self._factor)
        return out

    def checks(self, has_grad: torch.Tensor, *, check_overflow: bool) -> StepChecks:
        """Everything the step must agree on across ranks, in one small all-reduce (see StepChecks).

        ``has_grad`` is this rank's flags, one per parameter of every unit in order
        (``GradientReducer.local_has_grad``). Collective: call on all ranks.
        """
        device = self.comm.device
        if self.fp32_clipping:
            sq_norm = self._fp32_norm().double().pow(2).to(device)
        else:
            sq_norm = self._local_sq_norm().to(device)
        nonfinite = torch.zeros((), dtype=torch.float64, device=device)
        if check_overflow:
            # One flag per unit, combined where the gradients are: one host sync in all, not one per unit.
            flags = [self._finite(u).to(device) for u in self.units]
            if flags:
                nonfinite = (~torch.stack(flags).all()).to(torch.float64)
        # Sharded stages sum the squared norms of their shards; at stage 0 every rank holds the whole
        # reduced gradient, so its own norm is the global one and only the flags are summed.
        shared = sq_norm if self.plan.shard_optimizer else torch.zeros_like(sq_norm)
        flags64 = has_grad.to(device=device, dtype=torch.float64)
        packed = torch.cat([torch.stack([nonfinite, shared]), flags64])
        summed = self.comm.sum_scalar(packed, what="step checks all_reduce")
        if self.replica is not None:
            # The replicas hold the same shards: the norm is the shard group's; the flags span the world.
            rest = torch.cat([summed[:1], summed[2:]])
            rest = self.replica.sum_scalar(rest, what="step checks replica all_reduce")
            summed = torch.cat([rest[:1], summed[1:2], rest[1:]])
        summed = summed.cpu()  # the one host sync
        total = float(summed[1]) if self.plan.shard_optimizer else float(sq_norm)
        # The fp32 norm squared in float64 is exact, so its square root gives the fp32 norm back.
        return StepChecks(
            nonfinite=bool(summed[0] > 0),
            grad_norm=math.sqrt(total),  # nan or inf where the gradients are not finite
            has_grad=summed[2:] > 0,
        )

    def _finite(self, unit: FlatUnit) -> torch.Tensor:
        partial = self._partials(unit)
        return partial[1] if partial is not None else torch.isfinite(self._landed(unit)).all()

    def nonfinite_names(self) -> list[str]:
        """Names of this rank's parameters whose gradient pieces are not finite."""
        for unit in self.units:
            self._landed(unit)
        pieces = zip(self.slices, self._piece_grads(), strict=True)
        return [sl.unit.names[sl.piece.index] for sl, g in pieces if not bool(torch.isfinite(g).all())]

    def _piece_grads(self) -> Iterator[torch.Tensor]:
        """This rank's reduced gradient of each parameter piece, slice by slice (views)."""
        for sl in self.slices:
            start = sl.piece.shard_start
            yield self._grads[sl.unit.index][start : start + sl.piece.numel]

    def _local_sq_norm(self) -> torch.Tensor:
        """The squared L2 norm of this rank's reduced gradient pieces, as a float64 scalar tensor."""
        # One fp32 norm per parameter piece, as torch.nn.utils.clip_grad_norm_ takes one per parameter (no
        # fp64 copy of the gradients). Not one per unit: torch's CPU fp32 norm loses accuracy with length
        # (2 % off over 1.7e8 elements, 1e-5 over 1e6), so a whole-unit norm would clip differently. An
        # offloaded step may have taken a unit's norms already, where its shard was (the same values).
        parts = []
        for unit in self.units:
            partial = self._partials(unit)
            slices = self._unit_slices.get(unit.index, ())
            norms = partial[0] if partial is not None else piece_norms(self._landed(unit), slices)
            parts.append(norms.to(self.comm.device))
        if not parts:
            return torch.zeros((), dtype=torch.float64)
        return torch.cat(parts).double().pow(2).sum()

    def _fp32_norm(self) -> torch.Tensor:
        """The global L2 norm as DeepSpeed's stage 0 computes it in fp32 ([Note: DeepSpeed's fp32 clipping]):
        every rank holds every reduced gradient, so it is computed here alone."""
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in self._piece_grads() if g.numel()]
        if not norms:
            return torch.zeros((), dtype=torch.float32)
        norm = torch.stack(norms).pow(2).sum().pow(0.5)
        world = self.comm.world_size
        return norm / world * world  # DeepSpeed's average of the ranks' (equal) norms, rounding included

    def clip_coefficient(self, grad_norm: float, clip: float) -> float:
        """The factor clipping to ``clip`` (``gradient_clipping``, > 0 to clip) multiplies the gradients by,
        ``grad_norm`` being the norm :meth:`checks` returned; in fp32 where that norm is DeepSpeed's fp32 one
        ([Note: DeepSpeed's fp32 clipping])."""
        if not self.fp32_clipping or clip <= 0:
            return clip_coefficient(grad_norm, clip)
        norm = torch.tensor(grad_norm, dtype=torch.float32)
        return min(1.0, float(torch.tensor(clip, dtype=torch.float32) / (norm + 1e-6)))

    def scale_grads(self, factor: float) -> None:
        """Multiply the gradients the optimizer will see by ``factor`` (applied by :meth:`run`)."""
        self._factor *= factor

    def gather_params(self) -> None:
        """Copy stepped masters into the full parameters; all-gather them where shards differ per rank.

        At most ``allgather_bucket_size`` elements are in flight at once. Units whose parameters are sharded
        between uses (stage 3) are left alone: their next gather reads the parameter shard. After an
        offloaded step the parameters already hold the stepped values.
        """
        if not self._masters_written:
            for unit in self.units:
                unit.master_to_full()
        self._masters_written = False
        for unit in self.units:
            unit.store.flush()
        inflight: list[Pending] = []
        elements = 0
        for unit in self.units:
            if not unit.plan.gather_after_step:
                continue
            if inflight and elements + unit.layout.padded > self.allgather_bucket_size:
                for pending in inflight:
                    pending.wait()
                inflight, elements = [], 0
            what = f"parameter all_gather of unit {unit.index}"
            inflight.append(self.comm.all_gather(unit.full, unit.own_full_shard(), what=what))
            elements += unit.layout.padded
        for pending in inflight:
            pending.wait()


def clip_coefficient(grad_norm: float, clip: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` applies: ``clip / norm`` when the norm exceeds ``clip``
    (``gradient_clipping`` > 0), else 1."""
    if clip <= 0:
        return 1.0
    return min(1.0, clip / (grad_norm + 1e-6))
