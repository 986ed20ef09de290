"""``load_checkpoint``: fill a live engine from a checkpoint saved at any world size and stage.

Every rank reads, for each piece of its own shard, the overlapping elements of the saved ranges (see
reader.py), straight into its master shard; then one ``gather_params`` refreshes the full parameters. The
load first plans and verifies everything it will read (names, shapes, param groups, file sizes and
checksums) and all ranks agree that this succeeded before anything in the engine changes, so a bad
checkpoint raises the same error on every rank and leaves the engine as it was.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint import rng
from zeroshard.checkpoint.common import (
    collectively,
    data_loader,
    group_index,
    master_view,
    module_names,
    param_shape,
    untrained_state,
)
from zeroshard.checkpoint.deepspeed.reader import AnyReader, open_reader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import EXTRA_FILE, confined, resolve, tag_exists
from zeroshard.core.flat_param import FlatUnit, OptimizerSlice
from zeroshard.core.layout import Piece

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState

logger = logging.getLogger(__name__)


def _missing(root: str, tag: str | None) -> str | None:
    """The directory DeepSpeed would skip with a warning: ``root`` or an explicit tag's, when missing."""
    if not os.path.isdir(root):
        return root
    if tag is not None and not tag_exists(root, tag):
        return confined(root, tag, "tag=")
    return None


@dataclass
class _Plan:
    """What this rank will read: (unit, piece, stored name) per master piece, module entries, slices."""

    pieces: list[tuple[FlatUnit, Piece, str]] = field(default_factory=list)
    module: dict[str, tuple[Any, str]] = field(default_factory=dict)  # key -> (live value, stored name)
    slices: list[tuple[OptimizerSlice, str]] = field(default_factory=list)
    files: set[str] = field(default_factory=set)


def load_checkpoint(
    engine: TrainingState,
    load_dir: str | os.PathLike[str],
    tag: str | None = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, DeepSpeed's semantics.

    ``tag=None`` loads the checkpoint ``load_dir/latest`` names. As DeepSpeed, a missing ``load_dir``, a
    missing ``latest`` or a missing explicit ``tag`` logs a warning naming it and returns ``(None, None)``;
    a ``latest`` naming a missing tag is damage, a CheckpointError. RNG states are restored when the world
    size is the one saved with; the data loader ``initialize(training_data=...)`` returned continues from
    the saved position, at any world size (see zeroshard/runtime/data.py [Note: data position]). See
    [Note: saving inside an accumulation window] for what happens to partial gradients.

    Collective: call on all ranks of the engine's group.

    Returns:
        ``(checkpoint directory, client_state)``.
    """
    comm = engine.comm
    root = os.fspath(load_dir)
    missing = _missing(root, tag)
    if missing is not None:
        if comm.rank == 0:
            logger.warning("checkpoint %s does not exist: no checkpoint loaded", missing)
        return None, None
    path = resolve(root, tag)
    if path is None:
        if comm.rank == 0:
            logger.warning("no '%s' file in %s: no checkpoint loaded (pass tag= to name one)", "latest", root)
        return None, None
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    trained = module_names(engine.module, engine.units).trained
    names = [n for n, p in engine.module.named_parameters() if id(p) in trained]
    # Opening a DeepSpeed checkpoint reads (and may refuse) every rank file: all ranks agree it worked.
    reader = collectively(comm, f"opening checkpoint {path}", lambda: open_reader(path, names))
    with reader:
        plan = collectively(
            comm,
            f"checking checkpoint {path}",
            lambda: _plan(engine, reader, load_module_strict, with_optimizer),
        )

        def apply() -> Any:
            _load_tensors(engine.module, reader, plan)
            if with_optimizer:
                _load_optimizer(engine, reader, plan)
            if not load_module_only:
                _load_training_state(engine, reader, load_lr_scheduler_states)
            return reader.decode(reader.meta.get("client_state", {}))

        client_state = collectively(comm, f"loading checkpoint {path}", apply)
    engine.zero_grad()  # partial gradients of the window the checkpoint interrupted, if any
    engine.sharded_step.gather_params()
    if comm.rank == 0:
        meta = reader.meta
        logger.info(
            "loaded checkpoint %s (saved at world size %s, stage %s; now %s, %s)",
            path,
            meta["world_size"],
            meta["stage"],
            comm.world_size,
            engine.plan.stage,
        )
    return path, client_state


def _plan(engine: TrainingState, reader: AnyReader, strict: bool, with_optimizer: bool) -> _Plan:
    plan = _Plan()
    names = module_names(engine.module, engine.units)
    _check_names(reader, names.state_keys, strict)
    for unit in engine.units:
        for piece in unit.layout.pieces(unit.rank):
            name = unit.names[piece.index]
            stored = reader.canonical(name)
            if stored is None:
                continue  # missing: reported by _check_names when strict
            _check_shape(reader, name, stored, param_shape(unit, piece.index))
            plan.pieces.append((unit, piece, stored))
            end = piece.param_start + piece.numel
            plan.files.update(reader.files_for(stored, piece.param_start, end))
    for key, value in untrained_state(engine.module, names).items():
        stored = reader.canonical(key)
        if stored is None:
            continue
        if isinstance(value, torch.Tensor):
            _check_shape(reader, key, stored, tuple(value.shape))
            plan.files.update(reader.files_for(stored, 0, value.numel()))
        plan.module[key] = (value, stored)
    if with_optimizer:
        _plan_optimizer(engine, reader, plan)
    plan.files.add(EXTRA_FILE)
    reader.verify_files(plan.files)
    return plan


def _check_names(reader: AnyReader, state_keys: list[str], strict: bool) -> None:
    model = set(state_keys)
    missing = [k for k in state_keys if reader.canonical(k) is None]
    saved = [*reader.params, *reader.module_extra, *reader.aliases]
    unexpected = [k for k in saved if k not in model]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{reader.path} does not match the model (load_module_strict=True): missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    if missing or unexpected:
        logger.warning(
            "loading %s non-strictly: missing keys %s, unexpected keys %s", reader.path, missing, unexpected
        )


def _check_shape(reader: AnyReader, name: str, stored: str, shape: tuple[int, ...]) -> None:
    saved = reader.shape(stored)
    if saved != shape:
        raise CheckpointError(
            f"{reader.path}: {name!r} was saved with shape {list(saved)}, the model has {list(shape)}"
        )


def _plan_optimizer(engine: TrainingState, reader: AnyReader, plan: _Plan) -> None:
    opt = engine.optimizer
    saved = reader.meta.get("optimizer")
    if opt is None or saved is None:
        if saved is None:
            logger.warning("%s has no optimizer state: the optimizer keeps its own", reader.path)
        return
    if len(saved["param_groups"]) != len(opt.param_groups):
        raise CheckpointError(
            f"{reader.path}: the optimizer was saved with {len(saved['param_groups'])} param groups, the "
            f"live one has {len(opt.param_groups)}"
        )
    groups = group_index(opt)
    for sl in engine.sharded_step.slices:
        name = sl.unit.names[sl.piece.index]
        stored = reader.canonical(name)
        if stored is None or stored not in reader.params:
            continue  # not trained when saved: no state to load
        start, end = sl.piece.param_start, sl.piece.param_start + sl.piece.numel
        was = {r.group for r in reader.ranges[stored] if r.start < end and start < r.end}
        now = groups.get(id(sl.master))
        if was - {None, now}:
            raise CheckpointError(
                f"{reader.path}: parameter {name!r} is in param group {now} of the optimizer but was in "
                f"group {sorted(g for g in was if g is not None)} when saved"
            )
        reader.range_states(stored, start, end)  # raises if the saved ranges disagree
        plan.slices.append((sl, stored))
        plan.files.update(reader.files_for(stored, start, end))


def _load_tensors(module: torch.nn.Module, reader: AnyReader, plan: _Plan) -> None:
    with torch.no_grad():
        for unit, piece, stored in plan.pieces:
            reader.read_range(
                stored, piece.param_start, piece.param_start + piece.numel, out=master_view(unit, piece)
            )
        extra_state: dict[str, Any] = {}
        for key, (value, stored) in plan.module.items():
            if isinstance(value, torch.Tensor):
                value.data.copy_(reader.read_full(stored))
            elif "value" in reader.module_extra.get(stored, {}):
                extra_state[key] = reader.decode(reader.module_extra[stored]["value"])
        if extra_state:  # get_extra_state() values: load_state_dict hands them to set_extra_state()
            module.load_state_dict(extra_state, strict=False)


def _place(key: str, value: Any, master: torch.Tensor, group: dict[str, Any]) -> Any:
    """Optimizer state onto the master's device and dtype, as torch's Optimizer.load_state_dict does."""
    if not isinstance(value, torch.Tensor):
        return value
    if key == "step":
        return value.to(master.device) if group.get("capturable") or group.get("fused") else value
    if value.is_floating_point():
        return value.to(device=master.device, dtype=master.dtype)
    return value.to(master.device)


def _load_optimizer(engine: TrainingState, reader: AnyReader, plan: _Plan) -> None:
    opt = engine.optimizer
    saved = reader.meta.get("optimizer")
    if opt is None or saved is None:
        return
    for group, saved_group in zip(opt.param_groups, saved["param_groups"], strict=True):
        hyper = reader.decode(saved_group["hyperparameters"])
        group.update({k: v for k, v in hyper.items() if k != "params"})
    groups = group_index(opt)
    opt.state.clear()
    for sl, stored in plan.slices:
        start, end = sl.piece.param_start, sl.piece.param_start + sl.piece.numel
        keys = reader.range_states(stored, start, end)
        if not keys:
            continue
        group = opt.param_groups[groups[id(sl.master)]]
        opt.state[sl.master] = {
            key: _place(key, reader.read_state(stored, start, end, key), sl.master, group) for key in keys
        }


def _load_training_state(engine: TrainingState, reader: AnyReader, load_scheduler: bool) -> None:
    meta = reader.meta
    sched = meta.get("lr_scheduler")
    if load_scheduler and engine.lr_scheduler is not None:
        if sched is None:
            logger.warning("%s has no lr scheduler state: the scheduler keeps its own", reader.path)
        else:
            engine.lr_scheduler.load_state_dict(reader.decode(sched["state"]))
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None and meta.get("loss_scaler") is not None:
        scaler.load_state_dict(reader.decode(meta["loss_scaler"]["state"]))
    counters = meta["counters"]
    engine.global_steps = int(counters["global_steps"])
    engine.global_samples = int(counters["global_samples"])
    engine.skipped_steps = int(counters["skipped_steps"])
    # The start of the accumulation window the checkpoint was saved in (see [Note: saving inside an
    # accumulation window]).
    engine.micro_steps = engine.global_steps * engine.config.gradient_accumulation_steps
    _load_data_position(engine, reader)
    if meta.get("rng") is None:
        pass  # DeepSpeed checkpoints hold no RNG state
    elif meta["world_size"] == engine.comm.world_size:
        rng.set_rng_state(reader.decode(meta["rng"][engine.comm.rank]))
    elif engine.comm.rank == 0:
        logger.info(
            "RNG states not restored: saved at world size %s, running at %s",
            meta["world_size"],
            engine.comm.world_size,
        )


def _load_data_position(engine: TrainingState, reader: AnyReader) -> None:
    """Put the engine's data loader where the saved run's was (runtime/data.py [Note: data position])."""
    loader = data_loader(engine)
    saved = reader.meta.get("data")
    if loader is None:
        return
    if saved is None:
        if engine.comm.rank == 0:
            logger.warning(
                "%s holds no data loader position (it was saved without initialize(training_data=...)): "
                "the data loader stays where it is",
                reader.path,
            )
        return
    loader.load_state_dict(saved)
