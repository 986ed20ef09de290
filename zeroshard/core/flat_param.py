"""One unit's buffers: the full parameters, this rank's master shard and its gradient accumulator.

[Note: unit buffers]
For each unit (see ``layout.py`` [Note: flat layout]) this rank keeps:

* ``full``: the unit's whole flat space in the compute dtype. The module's parameters are views of it, so
  the model computes on it unchanged. At stages 0-2 it lives for the whole run.
* ``master``: this rank's shard in the master dtype, the only thing the optimizer steps. When master and
  compute dtypes agree (fp32 training) it *is* the shard of ``full``, so no second copy exists.
* the gradient accumulator, in the accumulation dtype: either ``grad_full`` (the whole flat space, kept
  when the stage does not shard gradients; ``grad_shard`` is then its own slice) or only ``grad_shard``.

[Note: gradient shards on demand]
Where gradients are sharded (stages 2, 3) a unit's ``grad_shard`` exists only from its first reduction
after a ``zero_grad`` to the next: the reduction's result becomes the shard (later micro-steps add into it)
and ``zero_grad``, which the engine calls after every step, drops it, as ``set_to_none`` drops a
parameter's ``.grad`` (FSDP2 does the same). So the forward, and the backward until each unit's gradients
arrive, run without the 4N/W bytes (fp32) of gradient shards: at the forward's end, where activations
peak, the model state is the parameters and the optimizer state only. Reading ``grad_shard`` when there is
none gives a zero shard (nothing was reduced); ``bytes_held`` counts the shard at its size either way, as
it is part of the model state at the step (beside a GPU it may live in CPU memory: move_grad_shard).

At stage 0 the shard world is 1: a rank's "shard" is the whole unit, which is how stage 0 steps everything
without a code path of its own.

A unit reaches its shards through the store it holds (``shard_store.py`` [Note: shard stores]): stepped
master values go into the parameters with :meth:`FlatUnit.master_to_full`, parameters changed by hand go
into the master with :meth:`FlatUnit.full_to_master`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.core.buffers import BufferPool
from zeroshard.core.comm import Comm, Pending
from zeroshard.core.copies import Copy
from zeroshard.core.layout import FlatLayout, Piece
from zeroshard.core.precision import DtypePolicy
from zeroshard.core.quantize import quantized_all_gather
from zeroshard.core.shard_store import InMemoryShards, ShardStore
from zeroshard.core.stages import StagePlan


@dataclass(frozen=True)
class OptimizerSlice:
    """One parameter's part of this rank's shard, as the optimizer sees it."""

    unit: FlatUnit
    piece: Piece
    master: torch.Tensor  # 1-D view into unit.master

    @property
    def param(self) -> nn.Parameter:
        return self.unit.params[self.piece.index]


class FlatUnit:
    """The buffers of one unit on this rank.

    Invariants: each ``params[i]`` is a view of ``full[offsets[i] : offsets[i] + numel]``; ``master`` has
    ``layout.shard_size`` elements; the padding of ``full``, ``master`` and the gradient buffers stays zero.
    """

    _grad_landing: Copy | None = None  # the copy bringing a moved gradient shard in: move_grad_shard
    full_exact = _secondary_exact = True  # ``full`` / ``secondary`` hold the masters as cast, not int8 (qwZ)

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
        # Where the shards live between uses: shard_store.py [Note: shard stores].
        self.store: ShardStore[FlatUnit] = InMemoryShards()
        self._gathering: Pending | None = None
        self.secondary: torch.Tensor | None = None  # hpZ: stage3/secondary.py [Note: hpZ secondary shards]
        self.pool: BufferPool | None = None  # the initial full buffer is not the pool's
        if plan.shard_parameters:
            self.release()
        self.pool = pool  # where gathered buffers come from and go back to (stage 3), see buffers.py
        self._grad_dtype = policy.accumulate
        self._grad_shard: torch.Tensor | None = None  # [Note: gradient shards on demand]
        if plan.shard_gradients:
            self.grad_full: torch.Tensor | None = None
        else:
            self.grad_full = torch.zeros(self.layout.padded, dtype=policy.accumulate, device=device)
            self._grad_shard = self.grad_full[lo:hi]
        self.grad_version = 0  # bumped by every gradient write: host_step.py [Note: overlapped offload step]
        # Which parameters received a gradient since the last zero_grad (on this rank).
        self.has_grad = torch.zeros(len(self.params), dtype=torch.bool)
        # Whether the gradient shard holds reduced values (set by the reducer; stages 0-1: at the boundary).
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
        """This rank's pieces of each parameter: the store's master tensors (1-D views of ``master`` when it
        is in memory)."""
        return [
            OptimizerSlice(
                unit=self,
                piece=piece,
                master=self.store.master_piece(self, piece.shard_start, piece.numel),
            )
            for piece in self.layout.pieces(self.rank)
        ]

    # -- stage 3: the full parameters exist only while gathered -------------------------------------
    @property
    def gathered(self) -> bool:
        return self.full.numel() > 0 or self.layout.padded == 0

    def start_gather(self, comm: Comm, *, from_secondary: bool = False, quantized: bool = False) -> None:
        """Launch the all-gather of the full parameters (no-op if gathered or on the way): of the primary
        shards over ``comm``, or with ``from_secondary`` of the secondary shards over ``comm``, the hpZ group
        ([Note: hpZ secondary shards]); with ``quantized`` in int8 (quantize.py [Note: quantized
        collectives]).

        Collective: call on all ranks of ``comm``, in the same unit order.
        """
        if self.gathered or self._gathering is not None:
            return
        source = self.secondary if from_secondary else self.param_shard
        if source is None:
            raise RuntimeError(
                f"rank {self.rank}: unit {self.index} ({self.names[0]}) has no secondary shard"
            )
        self.full = self._new_full()
        self.full_exact = not quantized and (self._secondary_exact or not from_secondary)
        # A shard in pinned CPU memory reaches the GPU through its store's copies (offload/host_shards.py).
        shard = source.to(device=self.device, dtype=self.policy.compute)
        what = f"parameter all_gather of unit {self.index} ({self.names[0]}, ...)"
        if quantized:
            self._gathering = quantized_all_gather(comm, self.full, shard, what=what)
        else:
            self._gathering = comm.all_gather(self.full, shard, what=what)

    def finish_gather(self) -> None:
        """Wait for a launched gather and point the parameters at the full buffer."""
        if self._gathering is None:
            return
        pending, self._gathering = self._gathering, None
        pending.wait()
        self.store.gathered(self)
        for param, offset, shape in zip(self.params, self.layout.offsets, self.shapes, strict=True):
            param.data = self.full[offset : offset + shape.numel()].view(shape)

    def keep_secondary(self, part: int, parts: int) -> None:
        """Keep slice ``part`` of ``parts`` of the gathered full buffer as this rank's secondary shard (no-op
        where one is kept): stage3/secondary.py [Note: hpZ secondary shards]."""
        if self.secondary is None and self.full.numel():
            size = self.layout.padded // parts
            self.secondary = self.full[part * size : (part + 1) * size].clone()
            self._secondary_exact = self.full_exact

    def drop_secondary(self) -> None:
        """Forget the secondary shard: the master shards changed, so it is stale."""
        self.secondary = None

    def release(self, keep_buffer: bool = True) -> None:
        """Free the full parameters; the parameters become empty placeholders until the next gather.

        The memory goes once nothing else refers to the old buffer: tensors autograd saves from it in
        forward are kept as references to the unit instead (``stage3/saved_views.py`` [Note: saved views]).
        Without ``keep_buffer`` the buffer goes back to the allocator, not to the pool's idle buffers.
        """
        if self._gathering is not None:
            self.finish_gather()
        empty = torch.empty(0, dtype=self.policy.compute, device=self.device)
        for param in self.params:
            param.data = empty
        old, self.full = self.full, empty
        if self.pool is not None and old.numel():
            self.pool.give(old, keep=keep_buffer)

    def release_before_gradients(self) -> None:
        """:meth:`release` while the gradients are still to come (stage 3, [Note: spent units] in
        ``stage3/spent_units.py``), the buffer to the allocator. Each parameter becomes a stand-in of its
        shape, one NaN broadcast over it: autograd checks a gradient against its parameter's shape and lays it
        out like the parameter's data, and a read of the values shows NaN, not numbers. :meth:`release` makes
        the parameters empty placeholders again."""
        self.release(keep_buffer=False)
        nan = torch.full((1,), float("nan"), dtype=self.policy.compute, device=self.device)
        for param, shape in zip(self.params, self.shapes, strict=True):
            param.data = nan.expand(shape)

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
        return self.store.param_shard(self)

    def prefetch_shard(self) -> None:
        """Start bringing ``param_shard`` into memory ahead of a gather (no-op where it always is)."""
        if not self.gathered and self._gathering is None:
            self.store.prefetch(self)

    def move_master(self, store: ShardStore[FlatUnit]) -> torch.Tensor:
        """Hand the separate master over to ``store``, which keeps it from now on (an offload store): return
        it and leave an empty placeholder in ``master``."""
        if not self.separate_master or not isinstance(self.store, InMemoryShards):
            raise RuntimeError(
                f"rank {self.rank}: unit {self.index} has no in-memory separate master to move"
            )
        master = self.master
        self.master = torch.empty(0, dtype=master.dtype, device=master.device)
        self.store = store
        return master

    def master_to_full(self, values: torch.Tensor | None = None, start: int = 0) -> None:
        """Write stepped master values into the parameters, through the store: ``values`` for shard elements
        ``start:start + numel`` (stepped outside the unit, e.g. by the NVMe swapper), or by default the whole
        in-memory ``master`` after the optimizer stepped it. Nothing to do where the parameters' shard is the
        master itself (stage 3 in memory, fp32 at stages 0-2 without a separate master). The secondary shard
        is stale from now on."""
        self.drop_secondary()
        self.store.master_to_full(self, values, start)

    def full_to_master(self) -> None:
        """Take this rank's slice of ``full`` (modified in place, e.g. by load_state_dict) into the master;
        the secondary shard is stale from now on."""
        self.check_write_back()
        self.drop_secondary()
        shard = self.own_full_shard()
        if shard.numel():
            self.store.full_to_master(self, shard)

    def check_write_back(self) -> None:
        """Refuse to take an int8-rounded ``full`` (qwZ) into the master: it would round the whole unit."""
        if self.gathered and not self.full_exact:
            raise RuntimeError(
                f"rank {self.rank}: unit {self.index} ({self.names[0]}, ...) is gathered in int8 for a "
                "running module (zero_quantized_weights): its values cannot be written back exactly; modify "
                "it outside the module's forward (GatheredParameters(modifier_rank=...))"
            )

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

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's gradient shard, in the accumulation dtype: zero where nothing was reduced since the
        last :meth:`zero_grad` ([Note: gradient shards on demand])."""
        if self._grad_landing is not None:
            self._grad_landing.wait()
            self._grad_landing = None
        return self.peek_grad_shard()

    def peek_grad_shard(self) -> torch.Tensor:
        """:attr:`grad_shard` without waiting for a copy bringing it in (for views read after it landed)."""
        if self._grad_shard is None:
            self._grad_shard = self._new_grad_shard()
            self._grad_shard.zero_()
        return self._grad_shard

    def move_grad_shard(self, home: torch.Tensor, landing: Copy) -> None:
        """The gradient shard lives in ``home`` (CPU memory) from now on, where ``landing`` copies it and
        :attr:`grad_shard` waits for it ([Note: overlapped offload step]). Stages 2-3 only."""
        if self.keeps_full_grad:
            raise RuntimeError(f"rank {self.rank}: unit {self.index} keeps its full gradient; it cannot move")
        self._grad_shard = home
        self._grad_landing = landing

    @property
    def holds_grad_shard(self) -> bool:
        return self._grad_shard is not None

    def _new_grad_shard(self) -> torch.Tensor:
        return torch.empty(self.layout.shard_size, dtype=self._grad_dtype, device=self.device)

    def add_reduced_grad(self, reduced: torch.Tensor, factor: float) -> None:
        """Add ``factor`` times ``reduced`` (this rank's part of a reduction) into the gradient shard; the
        first since :meth:`zero_grad` becomes the shard (the same values: there was nothing to add to)."""
        self.grad_version += 1
        if self._grad_shard is None:
            shard = self._new_grad_shard()
            shard.copy_(reduced).mul_(factor)
            self._grad_shard = shard
        else:  # the shard may have moved to CPU memory (move_grad_shard): add there
            shard = self.grad_shard
            shard.add_(reduced.to(device=shard.device, dtype=self._grad_dtype), alpha=factor)

    def grad_written(self) -> None:
        """Record an in-place write to the gradient shard (any but add_reduced_grad's and zero_grad's)."""
        self.grad_version += 1

    def zero_grad(self) -> None:
        self.grad_version += 1
        if self.keeps_full_grad:
            self.kept_grad().zero_()
        else:
            self._grad_shard = None  # [Note: gradient shards on demand]
            self._grad_landing = None
        self.has_grad.zero_()
        self.grad_reduced = False

    def bytes_held(self) -> dict[str, int]:
        """Bytes of the tensors this unit owns, by kind (shared storage counted once)."""
        params = self.full.numel() * self.full.element_size()
        grad_bytes = self.layout.shard_size * self._grad_dtype.itemsize  # held or not: at the step it is
        if self.keeps_full_grad:
            grad_bytes = self.kept_grad().numel() * self.kept_grad().element_size()
        master = 0 if not self.separate_master else (self.master.numel() * self.master.element_size())
        if self.secondary is not None:
            params += self.secondary.numel() * self.secondary.element_size()
        held = self.store.held_param_shard()
        if held is not None:
            params += held.numel() * held.element_size()
        elif self.plan.shard_parameters and self.policy.master_is_compute:
            # fp32 stage 3: the master shard is the parameter shard itself.
            params, master = params + master, 0
        return {"parameters": params, "gradients": grad_bytes, "master": master}


def unique_units(units: Iterable[FlatUnit]) -> list[FlatUnit]:
    """Each unit once, in the order first seen."""
    out: dict[int, FlatUnit] = {}
    for unit in units:
        out.setdefault(unit.index, unit)
    return list(out.values())
