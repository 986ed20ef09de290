"""What save, load and export all need from a live engine: names, aliases, pieces, and agreeing on errors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.layout import Piece
from zeroshard.runtime.data import ResumableDataLoader

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState

T = TypeVar("T")


def collectively(comm: Comm, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on this rank; if it raised on any rank, raise CheckpointError on every rank.

    So that a rank that fails (a missing file, a full disk) never leaves the others waiting in the next
    collective until it times out. Collective: call on all ranks.
    """
    error: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except Exception as err:  # reported to every rank below, then re-raised
        error = err
    reports = comm.all_gather_object(None if error is None else f"{error}")
    failed = [(rank, msg) for rank, msg in enumerate(reports) if msg is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {msg}" for rank, msg in failed)
        if error is not None and len(failed) == 1 and comm.world_size == 1:
            raise error
        raise CheckpointError(
            f"{what} failed on {len(failed)} of {comm.world_size} ranks: {detail}"
        ) from error
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Names:
    """How a module's state_dict names map to tensors.

    Attributes:
        aliases: a second (third, ...) name of a tied parameter or buffer -> its first name.
        trained: ``id`` of every parameter held in a unit -> its name there.
        state_keys: every key of ``module.state_dict()``, in order (aliases included).
    """

    aliases: dict[str, str]
    trained: dict[int, str]
    state_keys: list[str]


def module_names(module: nn.Module, units: Sequence[FlatUnit]) -> Names:
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    trained = {id(p): n for u in units for n, p in zip(u.names, u.params, strict=True)}
    return Names(aliases, trained, list(module.state_dict(keep_vars=True).keys()))


def untrained_state(module: nn.Module, names: Names) -> dict[str, Any]:
    """The module's state_dict entries that no unit holds (frozen parameters, buffers, extra state),
    without aliases."""
    return {
        key: value
        for key, value in module.state_dict(keep_vars=True).items()
        if key not in names.aliases and not (isinstance(value, torch.Tensor) and id(value) in names.trained)
    }


def written_pieces(engine: TrainingState) -> list[tuple[FlatUnit, Piece]]:
    """The pieces this rank writes: its own shard of every sharded unit; replicated units (world size 1:
    stage 0) are written by the first rank only. With hybrid sharding only the first shard group writes
    (the others hold the same shards: core/hybrid.py [Note: hybrid sharding]), a checkpoint laid out as one
    saved at the shard group's size."""
    replica = engine.sharded_step.replica
    if replica is not None and replica.rank != 0:
        return []
    out = []
    for unit in engine.units:
        if unit.layout.world_size == 1 and engine.comm.rank != 0:
            continue
        out += [(unit, piece) for piece in unit.layout.pieces(unit.rank)]
    return out


def slice_of(engine: TrainingState) -> dict[tuple[int, int], OptimizerSlice]:
    """This rank's optimizer slices by ``(unit index, parameter index in the unit)``."""
    return {(sl.unit.index, sl.piece.index): sl for sl in engine.sharded_step.slices}


def group_index(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """``id`` of each tensor the optimizer steps -> the index of its param group."""
    if optimizer is None:
        return {}
    return {id(t): gi for gi, g in enumerate(optimizer.param_groups) for t in g["params"]}


def param_shape(unit: FlatUnit, index: int) -> tuple[int, ...]:
    """The true shape of a unit's parameter, also while it is an empty placeholder (stage 3 between uses)."""
    shapes = getattr(unit, "shapes", None)
    return tuple(shapes[index] if shapes is not None else unit.params[index].shape)


def data_loader(engine: TrainingState) -> ResumableDataLoader | None:
    """The loader ``initialize(training_data=...)`` built, whose position checkpoints carry; None without
    one (a loader the user builds is theirs to checkpoint, in ``client_state``)."""
    loader = getattr(engine, "training_dataloader", None)
    return loader if isinstance(loader, ResumableDataLoader) else None


def data_position(engine: TrainingState) -> dict[str, Any] | None:
    """The loader's position at the start of the current accumulation window: where a resumed run
    restarts (see save.py [Note: saving inside an accumulation window])."""
    loader = data_loader(engine)
    if loader is None:
        return None
    return loader.state_dict(
        rewind=engine.micro_steps - engine.global_steps * engine.gradient_accumulation_steps()
    )


def master_view(unit: FlatUnit, piece: Piece) -> torch.Tensor:
    return unit.master[piece.shard_start : piece.shard_start + piece.numel]
