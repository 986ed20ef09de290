"""Which bytes of a collective cross a node boundary: arithmetic over the group's node layout.

[Note: bytes across nodes]
``CommStats.cross_node_bytes`` counts the bytes this rank *sends* to a rank on another node, from which node
each rank of the group is on (``Comm.nodes``, taken once at ``initialize`` from the launcher's variables:
``node_layout`` in zeroshard/dist.py; a single process, or a launch without them, is one node).

* The direct exchanges (gloo's all-gather and reduce-scatter, comm.py [Note: direct exchange]) send one
  message to each peer: every message to a peer on another node counts its size.
* torch's own collectives (all-reduce and broadcast, and NCCL's all-gather and reduce-scatter) are counted
  as the ring algorithm moves them, the ring being the group's ranks in order (each rank sends to the next,
  the last to the first). Per rank, to the next rank of the ring: an all-reduce of ``T`` bytes sends
  ``2 (n-1)/n T``, an all-gather or reduce-scatter of an ``F``-byte full buffer ``(n-1)/n F``, a broadcast
  of ``T`` bytes ``T`` (none from the rank just before the root). They count where the next rank is on
  another node. NCCL chooses between rings and trees, and orders its rings by topology, by itself: for
  NCCL this is the ring's figure, an estimate, not a measurement.

So on two nodes of two ranks each (ranks 0, 1 | 2, 3), ring or direct, an all-gather of ``F`` bytes over
all four ranks sends ``F/2`` across from every rank, and over one node nothing: hpZ's backward gathers
(``"hpz"`` group, hybrid.py [Note: hpZ groups]) with groups of two cross no node there.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["direct_cross_bytes", "ring_cross_bytes"]


def ring_cross_bytes(op: str, nbytes: int, rank: int, nodes: Sequence[int], *, root: int = 0) -> int:
    """The bytes rank ``rank`` of a group on ``nodes`` sends across nodes in a ring collective ``op``.

    ``nbytes`` is the collective's volume as comm.py counts it ([Note: communication volume]: ``2 T`` for
    an all-reduce of ``T`` bytes, the full buffer for an all-gather or reduce-scatter, ``T`` for a
    broadcast); ``root`` is the broadcast's source (group rank).
    """
    n = len(nodes)
    following = (rank + 1) % n
    if n == 1 or nodes[following] == nodes[rank]:
        return 0
    if op == "broadcast":
        return 0 if following == root else nbytes
    return (n - 1) * nbytes // n


def direct_cross_bytes(message_bytes: int, rank: int, nodes: Sequence[int]) -> int:
    """The bytes rank ``rank`` sends across nodes when it sends ``message_bytes`` to every other rank."""
    return message_bytes * sum(1 for r, node in enumerate(nodes) if r != rank and node != nodes[rank])
