"""What the gradient reducer reduces together, and how it averages: the reduction groups of
[Note: gradient flow] (``grad_sync.py``) and DeepSpeed's averaging factors, as data; and the error of
[Note: repeated gradients]."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.layout import GroupLayout, split_into_units


@dataclass(frozen=True)
class Averaging:
    """Gradient averaging as DeepSpeed does it: ``before`` multiplies gradients before the reduction,
    ``after`` the reduced sum (with ``prescale_gradients``, by the predivide factor and what remains of W)."""

    world_size: int
    prescale: bool = False
    predivide_factor: float = 1.0

    @property
    def before(self) -> float:
        return 1.0 / self.predivide_factor if self.prescale else 1.0

    @property
    def after(self) -> float:
        return self.predivide_factor / self.world_size if self.prescale else 1.0 / self.world_size


@dataclass(frozen=True)
class ReductionGroup:
    """Units whose gradients are reduced in one collective ([Note: coalesced reduction] in layout.py)."""

    index: int
    units: tuple[FlatUnit, ...]
    layout: GroupLayout

    @property
    def keeps_full(self) -> bool:
        """Whether its (single) unit keeps full gradients (stages 0, 1) instead of a transient bucket."""
        return self.units[0].keeps_full_grad


def _reduction_kind(unit: FlatUnit) -> tuple[bool, torch.dtype, torch.device]:
    """Units of one kind can share a bucket: transient buckets (not kept full gradients), one reduce dtype,
    one device."""
    return unit.keeps_full_grad, unit.policy.reduce, unit.full.device


def group_units(order: Sequence[FlatUnit], bucket_elements: int) -> list[list[FlatUnit]]:
    """Consecutive units of ``order`` whose transient buckets are reduced together: at most
    ``bucket_elements`` elements per group (a larger unit alone), one reduce dtype and device per group.
    Units that keep full gradients are reduced alone."""
    groups: list[list[FlatUnit]] = []
    for (keeps_full, _, _), same in itertools.groupby(order, key=_reduction_kind):
        run = list(same)
        if keeps_full:
            groups += [[u] for u in run]
        else:
            split = split_into_units([u.layout.padded for u in run], bucket_elements)
            groups += [[run[i] for i in indices] for indices in split]
    return groups


def reentrant_reuse_error(rank: int, unit: FlatUnit, what: str) -> RuntimeError:
    """The error of [Note: repeated gradients]; ``what`` says what happened to ``unit`` too late."""
    return RuntimeError(
        f"rank {rank}: {what} after the gradients of unit {unit.index} ({', '.join(unit.names)}) had "
        "gone to their reduction in this backward: the module ran in more than one reentrant "
        "activation-checkpointing region (torch.utils.checkpoint(use_reentrant=True) or "
        "deepspeed.checkpointing.checkpoint), or inside one and outside it, and each region's backward "
        "delivers a gradient of its own. Use use_reentrant=False (non-reentrant checkpointing gives each "
        "parameter one gradient per backward), or checkpoint every use of the shared module in one region"
    )
