"""The only module that calls ``torch.distributed`` collectives.

Every function takes its process group and tensors as arguments (no global group), counts the bytes it
moves, and bounds every wait by a timeout so that a collective that cannot complete raises instead of
hanging.

[Note: communication volume]
Bytes are counted the way the ZeRO paper counts volume: an all-reduce of Ψ bytes moves 2Ψ (it is a
reduce-scatter followed by an all-gather), a reduce-scatter moves its full input (Ψ) and an all-gather its
full output (Ψ). So a stage 0–2 training step moves 2Ψ and a stage-3 step 3Ψ, where Ψ is the size of the
model's trainable parameters in the communication dtype. At world size 1 nothing is sent and nothing is
counted. The same bytes are counted by the group they moved on (the Comm's ``label``), and the bytes this
rank sent to another node apart (traffic.py [Note: bytes across nodes]).

On gloo, all-gathers, reduce-scatters and all-to-alls are point-to-point exchanges: [Note: direct
exchange] in ``exchange.py``, which plans them; :meth:`Comm._exchange` sends and receives.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.exchange import (
    ExchangePlan,
    all_to_all_plan,
    exchange_tag,
    gather_plan,
    reduce_scatter_plan,
)
from zeroshard.core.liveness import APIS, Monitor, NullMonitor, entry_mismatch
from zeroshard.core.pending import (
    DEFAULT_TIMEOUT,
    DONE,
    TIMEOUT_ENV,
    Agreement,
    CommStats,
    Pending,
    collective_timeout,
)
from zeroshard.core.traffic import direct_cross_bytes, ring_cross_bytes

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV",
    "Agreement",
    "Comm",
    "CommStats",
    "Pending",
    "break_wait",
    "collective_timeout",
]


class Comm:
    """Collectives over one data-parallel process group, with byte counting and timeouts.

    ``group=None`` with no initialized process group means world size 1: every collective is the identity.
    ``timeout=None`` means :func:`collective_timeout`. ``monitor`` is told of every collective and wait (the
    liveness records, [Note: liveness] in zeroshard/watchdog/monitor.py); none: a :class:`NullMonitor`.
    ``label`` names the group in the byte counts by group (``CommStats.bytes_by_group``); ``nodes`` (node of
    each group rank, one node unless set) says which bytes cross nodes (traffic.py [Note: bytes across
    nodes]).

    Collective: every method that moves data must be called on all ranks of ``group``, in the same order.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: datetime.timedelta | None = None,
        *,
        monitor: Monitor | None = None,
        label: str = "world",
    ):
        self.group = group
        self.label = label
        self.timeout = timeout or collective_timeout()
        self.monitor: Monitor = monitor if monitor is not None else NullMonitor()
        self.stats = CommStats()
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            nccl = dist.get_backend(group) == "nccl"
        else:
            self.rank, self.world_size = 0, 1
            nccl = False
        # Where this group's tensors must be: NCCL moves CUDA tensors only (the current device, which
        # init_distributed set from LOCAL_RANK); gloo moves CPU tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        # gloo: all-gathers and reduce-scatters as point-to-point exchanges, see [Note: direct exchange].
        self.direct = not nccl and self.world_size > 1
        self._exchanges = 0  # exchanges issued on this group: the same count on every rank
        self.nodes = (0,) * self.world_size  # the node of each group rank (sets the remote-peer count)
        # What the liveness records name this group by (the same on every rank) and its global ranks.
        self.key = ""
        self.ranks: tuple[int, ...] = (0,)
        # How the heartbeat thread makes a wait on this group raise: gloo only (an NCCL wait does not block).
        self.breaker: Callable[[int], None] | None = None
        if self.world_size > 1:
            self.key = str((group or dist.group.WORLD).group_name)  # type: ignore[union-attr]
            self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            if not nccl:
                self.breaker = lambda peer: break_wait(self.group, peer, self.ranks)

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node of each rank of the group; setting it counts the peers on other nodes once."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: tuple[int, ...]) -> None:
        self._nodes = nodes
        self._remote_peers = direct_cross_bytes(1, self.rank, nodes)  # per byte sent to every peer

    def new_channel(self, label: str = "gather") -> Comm:
        """A second group over the same ranks, sharing this one's byte counts (counted under ``label``).

        Collectives on different groups never wait for each other, so traffic issued from different
        places (stage-3 parameter gathers from module hooks, gradient reductions from gradient hooks) can
        interleave differently on different ranks without deadlocking. Collective: call on all ranks
        (of the default group, as ``torch.distributed.new_group`` requires).
        """
        if self.world_size == 1:
            twin = Comm(None, self.timeout, monitor=self.monitor, label=label)
        else:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
            group = dist.new_group(ranks=ranks, timeout=self.timeout)
            twin = Comm(group, self.timeout, monitor=self.monitor, label=label)
        twin.stats = self.stats
        twin.nodes = self.nodes
        return twin

    def _count(self, kind: str, nbytes: int, cross_node: int) -> None:
        self.stats.add(kind, nbytes, group=self.label, cross_node=cross_node)

    def _launch(
        self,
        what: str,
        kind: str,
        nbytes: int,
        fn: Any,
        *args: Any,
        root: int = 0,
        cross: int | None = None,
        **kwargs: Any,
    ) -> Pending:
        if cross is None:
            cross = ring_cross_bytes(kind, nbytes, self.rank, self.nodes, root=root)
        self._count(kind, nbytes, cross)
        seq = self.monitor.note(self.key, kind, what)
        work = self._start(seq, what, lambda: fn(*args, group=self.group, async_op=True, **kwargs))
        return Pending(work, what, self.rank, self.timeout, stats=self.stats, op=kind, channel=self, seq=seq)

    def _pending(self, start: Callable[[], Any], what: str, kind: str) -> Pending:
        """A control collective (not counted as traffic), numbered for the liveness records."""
        seq = self.monitor.note(self.key, kind, what)
        return Pending(self._start(seq, what, start), what, self.rank, self.timeout, channel=self, seq=seq)

    def _start(self, seq: int, what: str, start: Callable[[], Any]) -> Any:
        """``start()``: launch collective #``seq``; a group already broken raises CollectiveError here."""
        try:
            return start()
        except RuntimeError as err:
            token = self.monitor.block(self.key, seq, what, self.ranks, self.breaker)
            try:
                raise self.monitor.failure(token, err, self.rank, self.timeout, 0.0) from err
            finally:
                self.monitor.unblock(token)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        what: str = "all_reduce",
    ) -> Pending:
        """Reduce ``tensor`` in place across ranks. Collective: call on all ranks."""
        if self.world_size == 1:
            return DONE
        nbytes = 2 * tensor.numel() * tensor.element_size()
        return self._launch(what, "all_reduce", nbytes, dist.all_reduce, tensor, op=op)

    def reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, *, what: str = "reduce_scatter"
    ) -> Pending:
        """Sum ``full`` (``world_size * output.numel()`` elements) across ranks; this rank gets its slice.

        Collective: call on all ranks.
        """
        if self.world_size == 1:
            output.copy_(full)
            return DONE
        nbytes = full.numel() * full.element_size()
        if self.direct:
            plan = reduce_scatter_plan(output, full, self.rank, self.world_size, self._remote_peers)
            return self._exchange(plan, what, "reduce_scatter", nbytes)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return self._launch(what, "reduce_scatter", nbytes, fn, output, full)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, *, what: str = "all_gather") -> Pending:
        """Gather every rank's ``shard`` into ``full``; ``shard`` may be this rank's slice of ``full``.

        Collective: call on all ranks.
        """
        if self.world_size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return DONE
        nbytes = full.numel() * full.element_size()
        if self.direct:
            return self._exchange(
                gather_plan(full, shard, self.rank, self._remote_peers), what, "all_gather", nbytes
            )
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return self._launch(what, "all_gather", nbytes, fn, full, shard)

    def all_to_all(
        self, received: torch.Tensor, sent: torch.Tensor, *, what: str = "all_to_all", op: str = "all_to_all"
    ) -> Pending:
        """Send chunk ``r`` of ``sent`` (``world_size`` equal chunks) to rank ``r``; chunk ``r`` of
        ``received`` gets rank ``r``'s chunk for this rank. ``op`` names it in the byte counts.

        Collective: call on all ranks."""
        if self.world_size == 1:
            received.copy_(sent)
            return DONE
        n, rank = sent.numel() // self.world_size, self.rank
        nbytes = sent.numel() * sent.element_size()
        cross = n * sent.element_size() * self._remote_peers  # one message per peer
        if self.direct:  # NCCL's all_to_all_single moves this rank's own chunk itself
            received[rank * n : (rank + 1) * n].copy_(sent[rank * n : (rank + 1) * n])
            return self._exchange(all_to_all_plan(received, sent, n, cross), what, op, nbytes)
        return self._launch(what, op, nbytes, dist.all_to_all_single, received, sent, cross=cross)

    # -- [Note: direct exchange] in exchange.py ------------------------------------------------------
    def _exchange(self, plan: ExchangePlan, what: str, op: str, nbytes: int) -> Pending:
        """Carry out ``plan``: each outgoing tensor and each incoming one a tagged message ([Note: direct
        exchange] in exchange.py)."""
        rank, world = self.rank, self.world_size
        outgoing, incoming = plan.outgoing, plan.incoming
        probe = outgoing((rank + 1) % world)
        self._exchanges += 1
        tag = exchange_tag(self._exchanges, probe.numel(), probe.dtype, what)
        seq = self.monitor.note(self.key, op, what)

        def start() -> list[Any]:
            works = []
            for k in range(1, world):
                dst, src = (rank + k) % world, (rank - k) % world
                works.append(dist.isend(outgoing(dst), group=self.group, group_dst=dst, tag=tag))
                works.append(dist.irecv(incoming(src), group=self.group, group_src=src, tag=tag))
            return works

        works = self._start(seq, what, start)
        self._count(op, nbytes, plan.cross)
        return Pending(
            works,
            what,
            rank,
            self.timeout,
            stats=self.stats,
            op=op,
            then=plan.then,
            channel=self,
            seq=seq,
            exchange=True,
        )

    @property
    def watched(self) -> bool:
        """Whether a wait on exchanges that the ranks issued differently fails within seconds, named, rather
        than only at the timeout: a heartbeat watches this group's monitor (see [Note: liveness]). The same on
        every rank from the heartbeat's start (collective) to its halt; should its store fail later, such a
        wait falls back to the timeout."""
        return self.direct and self.breaker is not None and self.monitor.watched

    def broadcast_from_first(self, tensor: torch.Tensor, *, what: str = "broadcast") -> Pending:
        """Overwrite ``tensor`` with the group's first rank's copy. Collective: call on all ranks."""
        return self.broadcast(tensor, src=0, what=what)

    def broadcast(self, tensor: torch.Tensor, *, src: int, what: str = "broadcast") -> Pending:
        """Overwrite ``tensor`` with group rank ``src``'s copy. Collective: call on all ranks."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"{what}: source rank {src} is outside the group's {self.world_size} ranks")
        if self.world_size == 1:
            return DONE
        root_rank = dist.get_global_rank(self.group, src) if self.group is not None else src
        nbytes = tensor.numel() * tensor.element_size()
        return self._launch(what, "broadcast", nbytes, dist.broadcast, tensor, src=root_rank, root=src)

    def barrier(self, *, what: str = "barrier") -> None:
        """Wait until every rank arrives (bounded by the timeout). Collective: call on all ranks."""
        if self.world_size == 1:
            return
        self._pending(lambda: dist.barrier(group=self.group, async_op=True), what, "barrier").wait()

    def all_gather_object(self, obj: Any, *, what: str = "all_gather_object") -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (small metadata only; the ranks of one job trust
        each other's pickles, as ``torch.distributed.all_gather_object`` does).

        Bounded by the timeout like every collective here: the sizes, then the padded bytes.
        Collective: call on all ranks.
        """
        if self.world_size == 1:
            return [obj]
        data = pickle.dumps(obj)
        sizes = [row[0] for row in self.agree_async([len(data)], what=f"{what} (sizes)").result()]
        longest = max(sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.device)
        out = torch.empty(self.world_size * longest, dtype=torch.uint8, device=self.device)
        self.stats.control_calls += 1
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._pending(
            lambda: fn(out, mine, group=self.group, async_op=True), what, "all_gather_object"
        ).wait()
        rows = out.cpu().view(self.world_size, longest)
        return [pickle.loads(rows[r, : sizes[r]].numpy().tobytes()) for r in range(self.world_size)]

    def check_entry(self, api: str, step: int | None) -> None:
        """Raise :class:`CollectiveError` on every rank unless every rank entered ``api`` (one of
        ``liveness.APIS``): a call on some ranks only is caught here by name when the others are in another
        API, and by the heartbeat (see [Note: liveness]) when they are elsewhere. Collective: all ranks."""
        if self.world_size == 1:
            return
        code = APIS.index(api)
        rows = self.agree_async([code, -1 if step is None else step], what=f"{api} entry check").result()
        error = entry_mismatch(api, rows, self.rank)
        if error is not None:
            raise error

    def agree(self, value: int, *, what: str) -> list[int]:
        """Every rank's ``value``, in rank order (one tiny fixed-size all-gather; not counted as traffic).

        Used before collectives whose sequence depends on control flow, so that ranks that took different
        paths meet in this check, which always matches in size, and can say so, instead of in a
        collective of another size. Collective: call on all ranks.
        """
        return [row[0] for row in self.agree_async([value], what=what).result()]

    def agree_async(self, values: list[int], *, what: str) -> Agreement:
        """Launch :meth:`agree` for a fixed-length list of ints; ``result()`` waits for every rank's list.

        Every rank must pass a list of the same length. Collective: call on all ranks.
        """
        if self.world_size == 1:
            return Agreement(DONE, torch.tensor([values], dtype=torch.int64))
        self.stats.control_calls += 1
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        pending = self._pending(lambda: fn(out, mine, group=self.group, async_op=True), what, "agree")
        return Agreement(pending, out.view(self.world_size, len(values)))

    def any_true(self, flags: torch.Tensor, *, what: str = "flag all_reduce") -> torch.Tensor:
        """Element-wise logical OR of a bool/uint8 tensor across ranks (small; not counted as model traffic).

        Collective: call on all ranks.
        """
        if self.world_size == 1:
            return flags
        self.stats.control_calls += 1
        buf = flags.to(device=self.device, dtype=torch.uint8)
        reduce = dist.all_reduce
        self._pending(
            lambda: reduce(buf, op=dist.ReduceOp.MAX, group=self.group, async_op=True), what, "all_reduce"
        ).wait()
        return buf.bool().to(flags.device)

    def sum_scalar(self, value: torch.Tensor, *, what: str = "scalar all_reduce") -> torch.Tensor:
        """Sum a small tensor across ranks (e.g. squared gradient norms). Collective: call on all ranks."""
        if self.world_size == 1:
            return value
        self.stats.control_calls += 1
        buf = value.to(self.device)
        self._pending(
            lambda: dist.all_reduce(buf, group=self.group, async_op=True), what, "all_reduce"
        ).wait()
        return buf


def break_wait(group: dist.ProcessGroup | None, peer: int, ranks: tuple[int, ...]) -> None:
    """Make a gloo wait on ``group`` that can never complete raise now (called by the heartbeat thread,
    see [Note: liveness]): a receive from ``peer`` (a global rank) that no one sends, timed out at once,
    makes gloo close the group's connections, and every wait on the group raises. Local."""
    try:
        probe = torch.empty(1)
        work = dist.irecv(probe, group=group, group_src=ranks.index(peer), tag=0x7EADBEEF)
        if work is not None:
            work.wait(timeout=datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the timeout that breaks the group
