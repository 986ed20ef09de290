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

[Note: direct exchange]
On gloo, :meth:`Comm.all_gather` and :meth:`Comm.reduce_scatter` do not call torch's
``all_gather_into_tensor`` / ``reduce_scatter_tensor``: each rank sends its shard (all-gather), or each
peer's chunk of its bucket (reduce-scatter), straight to every other rank with ``isend``/``irecv``,
receiving into the output itself; a reduce-scatter then sums the chunks in rank order, whichever rank sums.
gloo's reduce-scatter copies its input in the caller and costs about an all-reduce of the whole buffer, and
its all-gather of a transformer block's unit takes 2-3 times as long as the direct exchange on two cores
(``bench/comm_ops.py``; docs/benchmarks.md). Each rank sends and receives (W-1)/W of the buffer, the
ring algorithms' volume, and the bytes are counted as above. Messages are tagged with the exchange's
position in this group's sequence, its size and its ``what`` (the unit it moves): ranks whose sequences
diverged never pair messages of different sizes (gloo aborts the process on that) nor the same-sized
shards of different units (silently wrong parameters). They wait instead, and the heartbeat names the
collectives each rank launched at that point within a few seconds (``judge`` in
zeroshard/watchdog/verdicts.py), or the timeout does where no heartbeat runs. NCCL groups keep NCCL's
collectives. The direct exchange sends W-1 messages per rank per collective: right for data-parallel groups
of a few to a few tens of CPU ranks.
"""

from __future__ import annotations

import datetime
import pickle
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.core.liveness import APIS, CollectiveError, Monitor, NullMonitor
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
        self, what: str, kind: str, nbytes: int, fn: Any, *args: Any, root: int = 0, **kwargs: Any
    ) -> Pending:
        self._count(kind, nbytes, ring_cross_bytes(kind, nbytes, self.rank, self.nodes, root=root))
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
            return self._exchange_reduce_scatter(output, full, what, nbytes)
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
            return self._exchange_gather(full, shard, what, nbytes)
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
        received[rank * n : (rank + 1) * n].copy_(sent[rank * n : (rank + 1) * n])
        if self.direct:
            return self._exchange(
                lambda dst: sent[dst * n : (dst + 1) * n],
                lambda src: received[src * n : (src + 1) * n],
                what,
                op,
                nbytes,
                cross,
            )
        self._count(op, nbytes, cross)
        seq = self.monitor.note(self.key, op, what)
        work = self._start(
            seq, what, lambda: dist.all_to_all_single(received, sent, group=self.group, async_op=True)
        )
        return Pending(work, what, rank, self.timeout, stats=self.stats, op=op, channel=self, seq=seq)

    # -- [Note: direct exchange] ---------------------------------------------------------------------
    def _exchange_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str, nbytes: int) -> Pending:
        n, rank = shard.numel(), self.rank
        own = full[rank * n : (rank + 1) * n]
        if own.data_ptr() != shard.data_ptr():
            own.copy_(shard)
        cross = n * shard.element_size() * self._remote_peers
        return self._exchange(
            lambda dst: shard, lambda src: full[src * n : (src + 1) * n], what, "all_gather", nbytes, cross
        )

    def _exchange_reduce_scatter(
        self, output: torch.Tensor, full: torch.Tensor, what: str, nbytes: int
    ) -> Pending:
        n, rank, world = output.numel(), self.rank, self.world_size
        # Chunks are summed in rank order, whichever rank sums them. With two ranks the peer's chunk lands
        # in ``output`` itself (a + b == b + a); with more, every peer's chunk in a buffer of its own.
        inbox = [output] if world == 2 else list(torch.empty((world - 1, n), dtype=output.dtype))
        chunks: dict[int, torch.Tensor] = {rank: full[rank * n : (rank + 1) * n]}
        for k in range(1, world):
            chunks[(rank - k) % world] = inbox[k - 1]

        def total() -> None:
            if world == 2:
                output.add_(chunks[rank])
                return
            torch.add(chunks[0], chunks[1], out=output)
            for r in range(2, world):
                output.add_(chunks[r])

        cross = n * full.element_size() * self._remote_peers
        return self._exchange(
            lambda dst: full[dst * n : (dst + 1) * n],
            chunks.__getitem__,
            what,
            "reduce_scatter",
            nbytes,
            cross,
            total,
        )

    def _exchange(
        self,
        outgoing: Callable[[int], torch.Tensor],
        incoming: Callable[[int], torch.Tensor],
        what: str,
        op: str,
        nbytes: int,
        cross: int,
        then: Callable[[], None] | None = None,
    ) -> Pending:
        """Send ``outgoing(dst)`` to every other rank ``dst`` and receive ``incoming(src)`` from every
        other rank ``src``, each one tagged message ([Note: direct exchange]); ``then`` runs after all
        arrived."""
        rank, world = self.rank, self.world_size
        probe = outgoing((rank + 1) % world)
        tag = self._exchange_tag(probe.numel(), probe.dtype, what)
        seq = self.monitor.note(self.key, op, what)

        def start() -> list[Any]:
            works = []
            for k in range(1, world):
                dst, src = (rank + k) % world, (rank - k) % world
                works.append(dist.isend(outgoing(dst), group=self.group, group_dst=dst, tag=tag))
                works.append(dist.irecv(incoming(src), group=self.group, group_src=src, tag=tag))
            return works

        works = self._start(seq, what, start)
        self._count(op, nbytes, cross)
        return Pending(
            works,
            what,
            rank,
            self.timeout,
            stats=self.stats,
            op=op,
            then=then,
            channel=self,
            seq=seq,
            exchange=True,
        )

    def _exchange_tag(self, numel: int, dtype: torch.dtype, what: str) -> int:
        """The next exchange's message tag: from its position in this group's sequence, its size and what it
        moves, so that ranks whose sequences diverged never pair up their messages (they wait, and the
        heartbeat or the timeout names why). ``what`` must be the same on every rank."""
        self._exchanges += 1
        return zlib.crc32(f"{self._exchanges}:{numel}:{dtype}:{what}".encode()) & 0x7FFFFFFF

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
        if all(row[0] == code for row in rows):
            return
        by_api: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            name = APIS[row[0]] if 0 <= row[0] < len(APIS) else f"API #{row[0]}"
            by_api.setdefault(f"{name} (step {row[1]})" if row[1] >= 0 else name, []).append(r)
        sides = "; ".join(f"ranks {ranks} entered {name}" for name, ranks in by_api.items())
        raise CollectiveError(
            f"rank {self.rank}: the ranks called different collective APIs: {sides}. {api} is collective: "
            "call it on every rank (not under `if rank == 0:`), in the same order as the other collective "
            "calls"
        )

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
