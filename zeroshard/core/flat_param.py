"""One unit's buffers: the full parameters, this rank's master shard and its gradient accumulator.

[Note: unit buffers]
For each unit (see ``layout.py`` [Note: flat layout]) this rank keeps:

* ``full``: the unit's whole flat space in the compute dtype. The module's parameters are views of it, so
  the model computes on it unchanged. At stages 0-2 it lives for the whole run.
* ``master``: this rank's shard in the master dtype, the only thing the optimizer steps. When master and
  compute dtypes agree (fp32 training) it *is* the shard of ``full``, so no second copy exists.
* the gradient accumulator, in the accumulation dtype: either ``grad_full`` (the whole flat space, kept
  when the stage does not shard gradients; ``grad_shard`` is then its own slice) or only ``grad_shard``.

At stage 0 the shard world is 1: a rank's "shard" is the whole unit, which is how stage 0 steps everything
without a code path of its own.

[Note: offloaded master]
With the optimizer offloaded to NVMe (``offload/swapper.py``) a separate master lives in a file between
steps: ``master`` is then an empty placeholder, and at stage 3 ``param_shard`` (this rank's shard in the
compute dtype) is what gathers read. The parameters are the truth a stale master is re-derived from:
``copy_full_to_master`` only marks it (``master_stale``) and the swapper refreshes it when it next reads it.
With ``master_device`` (CPU offload beside a GPU) the master lives in CPU memory and the step runs there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm, Pending
from zeroshard.core.layout import FlatLayout, Piece
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.stages import StagePlan


class ShardHome(Protocol):
    """Where a unit's parameter shard lives between uses when it is not in memory (``offload_param`` nvme).

    The unit holds one and calls it; it never knows what kind of store it is (``offload.param_swap`` has the
    NVMe one). Implementations must return from :meth:`load` exactly what :meth:`store_range` last wrote.
    """

    def load(self, unit: FlatUnit) -> torch.Tensor:
        """This rank's parameter shard of ``unit``, read back (waits for a prefetch in flight)."""
        ...

    def prefetch(self, unit: FlatUnit) -> None:
        """Start reading ``unit``'s shard so that a later :meth:`load` finds it ready."""
        ...

    def drop(self, unit: FlatUnit) -> None:
        """Forget a loaded copy of ``unit``'s shard (the stored bytes stay)."""
        ...

    def store_range(self, unit: FlatUnit, start: int, values: torch.Tensor) -> None:
        """Write ``values`` over ``unit``'s stored shard from element ``start`` on."""
        ...


@dataclass(frozen=True)
class OptimizerSlice:
    """One parameter's part of this rank's shard, as the optimizer sees it."""

    unit: FlatUnit
    piece: Piece
    master: torch.Tensor  # 1-D view into unit.master
    grad: torch.Tensor  # 1-D view into unit.grad_shard

    @property
    def param(self) -> nn.Parameter:
        return self.unit.params[self.piece.index]


class FlatUnit:
    """The buffers of one unit on this rank.

    Invariants: each ``params[i]`` is a view of ``full[offsets[i] : offsets[i] + numel]``; ``master`` has
    ``layout.shard_size`` elements; the padding of ``full``, ``master`` and the gradient buffers stays zero.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        *,
        rank: int,
        world_size: int,
        plan: StagePlan,
        policy: DtypePolicy,
        master_device: torch.device | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        if not params:
            raise ValueError("a unit needs at least one parameter")
        self.index = index
        self.plan = plan
        self.params = list(params)
        self.names = list(names)
        self.rank = rank
        self.policy = policy
        self.layout = FlatLayout.for_shapes([p.numel() for p in params], world_size)
        device = self.device = params[0].device  # where the parameters compute
        lo, hi = self.layout.shard_range(rank)
        master_device = master_device or device
        separate_master = master_device != device or not (
            policy.master_is_compute and not plan.shard_parameters
        )
        # A separate master is taken from the parameters as given (fp32 when the model was built in fp32)
        # before they are cast to the compute dtype, so it starts exact.
        master = self._gather_own_pieces(policy.master, master_device) if separate_master else None
        self.full = torch.zeros(self.layout.padded, dtype=policy.compute, device=device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.layout.offsets, strict=True):
                view = self.full[offset : offset + param.numel()].view_as(param)
                view.copy_(param.detach())
                param.data = view
        self.master = master if master is not None else self.full[lo:hi]
        self.shapes = [p.shape for p in self.params]
        self.separate_master = separate_master
        self.master_offloaded = False
        self.master_stale = False
        self._param_shard: torch.Tensor | None = None
        self.param_home: ShardHome | None = None  # offload_param nvme: where param_shard lives
        self._gathering: Pending | None = None
        self.pool: BufferPool | None = None  # the initial full buffer is not the pool's
        if plan.shard_parameters:
            self.release()
        self.pool = pool  # where gathered buffers come from and go back to (stage 3), see buffers.py
        if plan.shard_gradients:
            self.grad_full: torch.Tensor | None = None
            self.grad_shard = torch.zeros(hi - lo, dtype=policy.accumulate, device=device)
        else:
            self.grad_full = torch.zeros(self.layout.padded, dtype=policy.accumulate, device=device)
            self.grad_shard = self.grad_full[lo:hi]
        # Which parameters received a gradient since the last zero_grad (on this rank).
        self.has_grad = torch.zeros(len(self.params), dtype=torch.bool)
        # Whether the gradient shard holds values reduced across ranks (set by the reducer): always once a
        # backward ran where gradients are sharded; at stages 0-1 from the boundary's reduction on.
        self.grad_reduced = False

    def _gather_own_pieces(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's shard of the parameters' current values, as a new tensor of ``dtype``."""
        pin = device.type == "cpu" and self.params[0].device.type == "cuda"
        out = torch.zeros(self.layout.shard_size, dtype=dtype, device=device, pin_memory=pin)
        for piece in self.layout.pieces(self.rank):
            flat = self.params[piece.index].detach().reshape(-1)
            out[piece.shard_start : piece.shard_start + piece.numel].copy_(
                flat[piece.param_start : piece.param_start + piece.numel]
            )
        return out

    @property
    def numel(self) -> int:
        return self.layout.total

    def param_range(self, i: int) -> tuple[int, int]:
        offset = self.layout.offsets[i]
        return offset, offset + self.layout.numels[i]

    def optimizer_slices(self) -> list[OptimizerSlice]:
        """This rank's pieces of each parameter, as 1-D views of ``master`` and ``grad_shard``.

        With the master offloaded each slice's master is a placeholder of its own, which the swapper points
        at real storage (``.data``) while the slice is resident.
        """
        return [
            OptimizerSlice(
                unit=self,
                piece=piece,
                master=(
                    torch.empty(0, dtype=self.master.dtype)
                    if self.master_offloaded
                    else self.master[piece.shard_start : piece.shard_start + piece.numel]
                ),
                grad=self.grad_shard[piece.shard_start : piece.shard_start + piece.numel],
            )
            for piece in self.layout.pieces(self.rank)
        ]

    # -- stage 3: the full parameters exist only while gathered -------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.numel() > 0 or self.layout.padded == 0

    def start_gather(self, comm: Comm) -> None:
        """Launch the all-gather of the full parameters (no-op if gathered or on the way).

        Collective: call on all ranks, in the same unit order.
        """
        if self.gathered or self._gathering is not None:
            return
        self.full = self._new_full()
        source = self.param_shard
        # From pinned CPU memory (ZeRO-Offload masters) the cast runs on the GPU after an async DMA; the
        # optimizer step waits for the stream before it writes the masters again (ShardedStep._step_grads).
        shard = source.to(device=self.device, dtype=self.policy.compute, non_blocking=self._host_to_device)
        self._gathering = comm.all_gather(
            self.full, shard, what=f"parameter all_gather of unit {self.index} ({self.names[0]}, ...)"
        )

    def finish_gather(self) -> None:
        """Wait for a launched gather and point the parameters at the full buffer."""
        if self._gathering is None:
            return
        pending, self._gathering = self._gathering, None
        pending.wait()
        if self.param_home is not None:
            self.param_home.drop(self)
        for param, offset, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True):
            param.data = self.full[offset : offset + shape.numel()].view(shape)

    def release(self) -> None:
        """Free the full parameters; the parameters become empty placeholders until the next gather.

        The memory goes once nothing else refers to the old buffer: tensors autograd saves from it in
        forward are kept as references to the unit instead (``saved_views`` [Note: saved views]).
        """
        if self._gathering is not None:
            self.finish_gather()
        empty = torch.empty(0, dtype=self.policy.compute, device=self.device)
        for param in self.params:
            param.data = empty
        old, self.full = self.full, empty
        if self.pool is not None and old.numel():
            self.pool.give(old)

    def _new_full(self) -> torch.Tensor:
        numel, dtype = self.layout.padded, self.policy.compute
        if self.pool is None:
            return torch.empty(numel, dtype=dtype, device=self.device)
        return self.pool.take(numel, dtype, self.device)

    def own_full_shard(self) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.rank)
        return self.full[lo:hi]

    @property
    def param_shard(self) -> torch.Tensor:
        """This rank's shard of the parameters as stored between uses: what a stage-3 gather reads."""
        if self._param_shard is not None:
            return self._param_shard
        if self.param_home is not None:
            return self.param_home.load(self)
        return self.master if self.plan.shard_parameters else self.own_full_shard()

    def drop_param_shard(self) -> None:
        """Forget the in-memory ``param_shard`` (its home, an NVMe file, keeps it)."""
        if self.param_home is None:
            raise RuntimeError(f"rank {self.rank}: unit {self.index}'s parameter shard has no other home")
        self._param_shard = None

    def prefetch_shard(self) -> None:
        """Start reading ``param_shard`` from its NVMe home ahead of a gather (no-op in memory)."""
        if self.param_home is not None and not self.gathered and self._gathering is None:
            self.param_home.prefetch(self)

    def offload_master(self) -> torch.Tensor:
        """Hand the master to the offload store: return it and keep an empty placeholder in its place.

        At stage 3 a compute-dtype copy of the shard stays (``param_shard``) for gathers to read.
        """
        if not self.separate_master or self.master_offloaded:
            raise RuntimeError(f"rank {self.rank}: unit {self.index} has no separate master to offload")
        master = self.master
        if self.plan.shard_parameters:
            same = master.dtype == self.policy.compute and master.device == self.device
            self._param_shard = master if same else master.to(self.device, self.policy.compute)
        self.master = torch.empty(0, dtype=master.dtype, device=master.device)
        self.master_offloaded = True
        return master

    def take_stepped_master(self, start: int, master: torch.Tensor) -> None:
        """Write stepped master values (shard elements ``start:start + numel``) into the parameters."""
        if self.param_home is not None:
            self.param_home.store_range(self, start, master)
        elif self.plan.shard_parameters:
            self.param_shard[start : start + master.numel()].copy_(master)
        else:
            self.own_full_shard()[start : start + master.numel()].copy_(master)

    def copy_master_to_full(self) -> None:
        """Write the stepped master shard into this rank's slice of ``full`` (a cast, if dtypes differ)."""
        if self.plan.shard_parameters or not self.master.numel():
            return  # the next gather reads the master, or it is offloaded (the swapper wrote each sub-group)
        shard = self.own_full_shard()
        if shard.data_ptr() != self.master.data_ptr():
            shard.copy_(self.master, non_blocking=self._host_to_device)  # see start_gather

    @property
    def _host_to_device(self) -> bool:
        """Whether the master lives in CPU memory beside a GPU (pinned: copies to the GPU may be async)."""
        return self.device.type == "cuda" and self.master.device.type == "cpu"

    def copy_full_to_master(self) -> None:
        """Take this rank's slice of ``full`` (modified in place, e.g. by load_state_dict) into the master."""
        shard = self.own_full_shard()
        if not shard.numel():
            return
        if self.master_offloaded:
            if self.param_home is not None:
                self.param_home.store_range(self, 0, shard)
            elif self._param_shard is not None:
                self._param_shard.copy_(shard)
            self.master_stale = True  # see [Note: offloaded master]
        elif shard.data_ptr() != self.master.data_ptr():
            self.master.copy_(shard)

    @property
    def keeps_full_grad(self) -> bool:
        """Whether this unit keeps the whole flat gradient between micro-steps (the plan does not shard
        gradients: stages 0, 1) instead of only its own shard."""
        return not self.plan.shard_gradients

    def kept_grad(self) -> torch.Tensor:
        """The whole flat gradient accumulator of a unit that ``keeps_full_grad``.

        Raises:
            RuntimeError: the unit's plan shards gradients, so no full accumulator exists.
        """
        if self.grad_full is None:
            raise RuntimeError(
                f"unit {self.index} ({self.names[0]}): stage {self.plan.stage} keeps no full gradient"
            )
        return self.grad_full

    def zero_grad(self) -> None:
        if self.keeps_full_grad:
            self.kept_grad().zero_()
        else:
            self.grad_shard.zero_()
        self.has_grad.zero_()
        self.grad_reduced = False

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this unit owns, by kind (shared storage counted once)."""
        params = self.full.numel() * self.full.element_size()
        grads = self.kept_grad() if self.keeps_full_grad else self.grad_shard
        master = 0 if not self.separate_master else (self.master.numel() * self.master.element_size())
        if self._param_shard is not None:
            params += self._param_shard.numel() * self._param_shard.element_size()
        elif self.plan.shard_parameters and self.policy.master_is_compute:
            # fp32 stage 3: the master shard is the parameter shard itself.
            params, master = params + master, 0
        return {"parameters": params, "gradients": grads.numel() * grads.element_size(), "master": master}
