"""This rank's optimizer slices, grouped by unit, and the norms of their gradient pieces: what both steps
(``ShardedStep`` in optimizer.py and the offloaded ``HostStep``) compute the gradient norm from."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zeroshard.core.flat_param import OptimizerSlice

__all__ = ["piece_norms", "slices_by_unit"]


def slices_by_unit(slices: Iterable[OptimizerSlice]) -> dict[int, list[OptimizerSlice]]:
    """The slices of each unit (by ``unit.index``), in the order given."""
    by_unit: dict[int, list[OptimizerSlice]] = {}
    for sl in slices:
        by_unit.setdefault(sl.unit.index, []).append(sl)
    return by_unit


def piece_norms(grad: torch.Tensor, slices: Iterable[OptimizerSlice]) -> torch.Tensor:
    """The fp32 norm of each slice's piece of ``grad`` (its unit's gradient shard), in order, empty pieces
    left out: a 1-D tensor where ``grad`` lives (the terms of ``ShardedStep``'s gradient norm)."""
    norms = [
        torch.linalg.vector_norm(
            grad[sl.piece.shard_start : sl.piece.shard_start + sl.piece.numel], dtype=torch.float32
        )
        for sl in slices
        if sl.piece.numel
    ]
    return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float32, device=grad.device)
