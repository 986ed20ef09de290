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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Comm, Pending
from zeroshard.layout import FlatLayout, Piece
from zeroshard.precision import DtypePolicy
from zeroshard.stages import StagePlan


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
        device = params[0].device
        lo, hi = self.layout.shard_range(rank)
        separate_master = not (policy.master_is_compute and not plan.shard_parameters)
        # A separate master is taken from the parameters as given (fp32 when the model was built in fp32)
        # before they are cast to the compute dtype, so it starts exact.
        master = self._gather_own_pieces(policy.master) if separate_master else None
        self.full = torch.zeros(self.layout.padded, dtype=policy.compute, device=device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.layout.offsets, strict=True):
                view = self.full[offset : offset + param.numel()].view_as(param)
                view.copy_(param.detach())
                param.data = view
        self.master = master if master is not None else self.full[lo:hi]
        self.shapes = [p.shape for p in self.params]
        self._gathering: Pending | None = None
        if plan.shard_parameters:
            self.release()
        if plan.shard_gradients:
            self.grad_full: torch.Tensor | None = None
            self.grad_shard = torch.zeros(hi - lo, dtype=policy.accumulate, device=device)
        else:
            self.grad_full = torch.zeros(self.layout.padded, dtype=policy.accumulate, device=device)
            self.grad_shard = self.grad_full[lo:hi]
        # Which parameters received a gradient since the last zero_grad (on this rank).
        self.has_grad = torch.zeros(len(self.params), dtype=torch.bool)

    def _gather_own_pieces(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shard of the parameters' current values, as a new tensor of ``dtype``."""
        out = torch.zeros(self.layout.shard_size, dtype=dtype, device=self.params[0].device)
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
        """This rank's pieces of each parameter, as 1-D views of ``master`` and ``grad_shard``."""
        return [
            OptimizerSlice(
                unit=self,
                piece=piece,
                master=self.master[piece.shard_start : piece.shard_start + piece.numel],
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
        self.full = torch.empty(self.layout.padded, dtype=self.policy.compute, device=self.master.device)
        shard = (
            self.master if self.master.dtype == self.policy.compute else self.master.to(self.policy.compute)
        )
        self._gathering = comm.all_gather(
            self.full, shard, what=f"parameter all_gather of unit {self.index} ({self.names[0]}, ...)"
        )

    def finish_gather(self) -> None:
        """Wait for a launched gather and point the parameters at the full buffer."""
        if self._gathering is None:
            return
        pending, self._gathering = self._gathering, None
        pending.wait()
        for param, offset, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True):
            param.data = self.full[offset : offset + shape.numel()].view(shape)

    def release(self) -> None:
        """Free the full parameters; the parameters become empty placeholders until the next gather."""
        if self._gathering is not None:
            self.finish_gather()
        empty = torch.empty(0, dtype=self.policy.compute, device=self.master.device)
        for param in self.params:
            param.data = empty
        self.full = empty

    def own_full_shard(self) -> torch.Tensor:
        lo, hi = self.layout.shard_range(self.rank)
        return self.full[lo:hi]

    def copy_master_to_full(self) -> None:
        """Write the stepped master shard into this rank's slice of ``full`` (a cast, if dtypes differ)."""
        if self.plan.shard_parameters:
            return  # the next gather reads the master
        shard = self.own_full_shard()
        if shard.data_ptr() != self.master.data_ptr():
            shard.copy_(self.master)

    def copy_full_to_master(self) -> None:
        """Take this rank's slice of ``full`` (modified in place, e.g. by load_state_dict) into the master."""
        shard = self.own_full_shard()
        if shard.numel() and shard.data_ptr() != self.master.data_ptr():
            self.master.copy_(shard)

    def zero_grad(self) -> None:
        if self.grad_full is not None:
            self.grad_full.zero_()
        else:
            self.grad_shard.zero_()
        self.has_grad.zero_()

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this unit owns, by kind (shared storage counted once)."""
        params = self.full.numel() * self.full.element_size()
        grads = self.grad_full if self.grad_full is not None else self.grad_shard
        master = (
            0
            if self.master.data_ptr() == self.own_full_shard().data_ptr()
            else (self.master.numel() * self.master.element_size())
        )
        if self.plan.shard_parameters and self.policy.master_is_compute:
            # fp32 stage 3: the master shard is the parameter shard itself.
            params, master = params + master, 0
        return {"parameters": params, "gradients": grads.numel() * grads.element_size(), "master": master}
