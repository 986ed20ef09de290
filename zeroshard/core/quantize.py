"""ZeRO++'s quantized collectives: stage 3's parameter all-gather and gradient reduce-scatter in int8.

[Note: quantized collectives]
``zero_quantized_weights`` (DeepSpeed's qwZ) and ``zero_quantized_gradients`` (qgZ), at stage 3 as in
DeepSpeed. Both are lossy: a model trains close to, not equal to, the unquantized run.

* The format: a tensor of ``n`` elements is cut into blocks of ``BLOCK`` elements (the last one padded with
  zeros); each block keeps one fp32 scale, ``max|x| / 127``, and its elements as ``round(x / scale)`` in int8.
  A packet is the int8 values followed by the scales' bytes, ``nb * (BLOCK + 4)`` bytes for ``nb`` blocks:
  1.016 bytes per element instead of 2 (bf16) or 4 (fp32). Dequantizing gives ``q * scale``, within
  ``scale / 2`` of the input. An all-zero block has scale 0 and comes back as zeros. A block holding a NaN or
  an infinity gets a non-finite scale and comes back all non-finite, so the fp16 overflow check and the
  non-finite policy see it.
* Weights: every rank packs its compute-dtype shard, the packets are all-gathered (over the gather group, as
  the unquantized shards would be), and every rank dequantizes all of them, its own included, so that every
  rank computes with the same parameters. The masters and the shards the optimizer steps stay exact; only
  what the forward and backward compute with is rounded. Gathers whose values a user reads or writes back
  (``GatheredParameters``, state dicts: ``GatherSource.start(exact=True)``) are never quantized. hpZ's
  secondary shards (stage3/secondary.py) are cut from the dequantized forward gather and gathered
  unquantized inside the node, as DeepSpeed's hpZ.
* Gradients: each rank packs the chunk of its bucket that each peer owns and sends it with an all-to-all
  (DeepSpeed's qgZ replaces the reduce-scatter with all-to-alls too); the owner dequantizes the chunks it
  receives and sums them in rank order with its own chunk, which it keeps exact. One quantization per
  gradient and step: DeepSpeed's qgZ quantizes twice (int4 inside the node, then int8 across).
* A collective whose packets would not be smaller than its plain chunks (fewer than about 130 elements per
  rank in fp32, 260 in bf16: a tiny unit, or a bias kept in a unit of its own) runs unquantized. The choice
  follows from the chunk's size and dtype, the same on every rank. Units that stay gathered (under
  ``stage3_param_persistence_threshold``) are refreshed after the optimizer step by the exact all-gather of
  stages 1-2 (``ShardedStep.gather_params``).
* Memory: quantizing holds an fp32 copy of what it packs (the shard, or the whole gradient bucket) and its
  packets, transiently; DeepSpeed's fused kernels do not.
* The byte counts (comm.py [Note: communication volume]) are the packets', under ``all_gather`` and
  ``reduce_scatter`` as the unquantized collectives, so a stage-3 step's volume is ``3Ψ`` with Ψ the packed
  size for the quantized collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from zeroshard.core.comm import Comm
from zeroshard.core.pending import Pending

__all__ = [
    "BLOCK",
    "dequantize",
    "packed_bytes",
    "quantize",
    "quantized_all_gather",
    "quantized_reduce_scatter",
    "reduce_scatter_for",
]

BLOCK = 256  # elements per scale: 4 bytes of scale per 256 of int8 values, 1.6% on top
_LEVELS = 127.0


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def packed_bytes(n: int) -> int:
    """The bytes of the packet of ``n`` elements."""
    return _blocks(n) * (BLOCK + 4)


def _pays(comm: Comm, chunk: torch.Tensor) -> bool:
    """Whether quantizing ``chunk`` (per rank) sends fewer bytes; False at world size 1 (nothing is sent)."""
    return comm.world_size > 1 and packed_bytes(chunk.numel()) < chunk.numel() * chunk.element_size()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Pack the rows of ``x`` (one row, or ``[rows, n]``) into packets of int8 values and fp32 scales:
    uint8 ``[rows, packed_bytes(n)]`` (``[packed_bytes(n)]`` for a 1-D ``x``)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    count, n = rows.shape
    nb = _blocks(n)
    padded = torch.zeros((count, nb * BLOCK), dtype=torch.float32, device=x.device)
    padded[:, :n] = rows
    blocks = padded.view(count, nb, BLOCK)
    scale = blocks.abs().amax(dim=2) / _LEVELS  # NaN and inf stay in the scale
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(2)
    q = torch.nan_to_num(blocks / divisor, nan=0.0, posinf=_LEVELS, neginf=-_LEVELS)
    q = q.round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    packet = torch.empty((count, nb * (BLOCK + 4)), dtype=torch.uint8, device=x.device)
    packet[:, : nb * BLOCK] = q.view(count, nb * BLOCK).view(torch.uint8)
    packet[:, nb * BLOCK :] = scale.view(torch.uint8)
    return packet.view(-1) if x.dim() == 1 else packet


def dequantize(packets: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """Unpack ``packets`` (uint8 ``[rows, packed_bytes(n)]``, or one packet) into ``out`` (``rows * n``
    elements, any float dtype): ``q * scale`` per block."""
    nb = _blocks(n)
    rows = packets.view(-1, nb * (BLOCK + 4))
    q = rows[:, : nb * BLOCK].view(torch.int8).view(-1, nb, BLOCK).to(torch.float32)
    scale = rows[:, nb * BLOCK :].contiguous().view(torch.float32).unsqueeze(2)
    values = (q * scale).view(-1, nb * BLOCK)[:, :n]
    out.view(-1, n).copy_(values)
    return out


def quantized_all_gather(comm: Comm, full: torch.Tensor, shard: torch.Tensor, *, what: str) -> Pending:
    """``comm.all_gather(full, shard)`` in int8 ([Note: quantized collectives]); ``full`` holds every rank's
    dequantized shard, this rank's included, once waited for. Unquantized where that would not send fewer
    bytes (world size 1, a small shard).

    Collective: call on all ranks of ``comm``."""
    if not _pays(comm, shard):
        return comm.all_gather(full, shard, what=what)
    n = shard.numel()
    packet = quantize(shard)
    everyone = torch.empty(comm.world_size * packet.numel(), dtype=torch.uint8, device=shard.device)
    pending = comm.all_gather(everyone, packet, what=f"{what} (int8)")

    def unpack() -> None:
        dequantize(everyone, n, full)

    return pending.and_then(unpack)


def reduce_scatter_for(comm: Comm, quantized: bool) -> Callable[..., Pending]:
    """``comm``'s gradient reduce-scatter: :func:`quantized_reduce_scatter` over it, or its plain one."""
    return partial(quantized_reduce_scatter, comm) if quantized else comm.reduce_scatter


def quantized_reduce_scatter(comm: Comm, output: torch.Tensor, full: torch.Tensor, *, what: str) -> Pending:
    """``comm.reduce_scatter(output, full)`` with the chunks sent in int8 ([Note: quantized collectives]): the
    peers' chunks are dequantized and summed in rank order with this rank's own, exact. Unquantized where
    that would not send fewer bytes (world size 1, small chunks).

    Collective: call on all ranks of ``comm``."""
    world, rank, n = comm.world_size, comm.rank, output.numel()
    if not _pays(comm, full[:n]):
        return comm.reduce_scatter(output, full, what=what)
    sent = quantize(full.view(world, n))
    received = torch.empty_like(sent)
    pending = comm.all_to_all(received.view(-1), sent.view(-1), what=f"{what} (int8)", op="reduce_scatter")

    def total() -> None:
        chunks = dequantize(received, n, torch.empty((world, n), dtype=torch.float32, device=output.device))
        chunks[rank] = full[rank * n : (rank + 1) * n]
        output.copy_(chunks[0])
        for r in range(1, world):
            output.add_(chunks[r])

    return pending.and_then(total)
