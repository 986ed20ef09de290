"""``save_checkpoint``: every rank writes its shard; rank 0 writes metadata and publishes atomically.

[Note: atomic save]
1. All ranks agree on the tag and a random token; rank 0 creates ``<save_dir>/.<tag>.tmp-<token>/``.
2. Each rank writes its shard file there and fsyncs it, hashing the bytes as they are written.
3. The file records (names, ranges, sizes, sha256) and RNG states go to rank 0 (``all_gather_object``);
   a failure on any rank is raised on every rank and the temporary directory is removed.
4. Rank 0 writes ``extra.safetensors`` and ``metadata.json``, fsyncs them and the directory; barrier.
5. Rank 0 renames the directory to ``<save_dir>/<tag>`` (a tag saved before is first renamed aside to
   ``.<tag>.old-<token>``, which loading falls back to if a crash falls between the two renames), then
   replaces ``latest`` atomically (temp file, fsync, ``os.replace``), then deletes leftovers of
   interrupted saves.

A crash before step 5 leaves only a ``.tmp-`` directory, which nothing reads; a crash inside step 5
leaves ``latest`` naming either the previous checkpoint or the new complete one.

[Note: saving inside an accumulation window]
Like DeepSpeed, a checkpoint holds model and optimizer state, not the gradients accumulated by the
micro-steps of an unfinished window. Loading restores the counters to the start of that window
(``micro_steps = global_steps * gradient_accumulation_steps``) and drops any partial gradients, so a
resumed run replays the window's micro-batches from its first. The data loader's position is recorded
as it was at the window's start, for the same reason (zeroshard/runtime/data.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint import rng
from zeroshard.checkpoint.common import (
    Names,
    collectively,
    data_position,
    group_index,
    master_view,
    module_names,
    param_shape,
    slice_of,
    untrained_state,
    written_pieces,
)
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    EXTRA_FILE,
    FORMAT,
    METADATA_FILE,
    VERSION,
    check_key_part,
    check_tag,
    encode,
    old_dir_name,
    range_key,
    read_latest,
    shard_file_name,
    stale_temp_dirs,
    temp_dir_name,
    write_latest,
    write_metadata,
)
from zeroshard.checkpoint.reader import FIXED, SCALAR, VALUE, VECTOR
from zeroshard.checkpoint.tensorfile import TensorSpec, dtype_name, fsync_dir, write_tensors
from zeroshard.errors import ArgumentError

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState

logger = logging.getLogger(__name__)


def save_checkpoint(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    keep_last: int | None = None,
) -> str:
    """Save model, optimizer, scheduler, loss scaler, counters, RNG, the position of the data loader
    ``initialize(training_data=...)`` returned, and client state to ``save_dir/tag``.

    ``keep_last=N`` (opt-in; DeepSpeed keeps every tag) then deletes the oldest checkpoints of ``save_dir``
    beyond the newest ``N``, never the one just written nor the one ``latest`` names.

    See [Note: checkpoint format] and [Note: atomic save]. ``client_state`` may hold JSON values and
    tensors (nothing else: it is never pickled); a script with its own data loader keeps its position
    there.

    Collective: call on all ranks of the engine's group.

    Returns:
        The checkpoint directory.
    """
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"save_checkpoint(keep_last={keep_last!r}): expected None or an int >= 1")
    comm = engine.comm
    tag = _agree_on_tag(engine, f"global_step{engine.global_steps}" if tag is None else str(tag))
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
    root = os.path.abspath(os.fspath(save_dir))
    tmp = os.path.join(root, temp_dir_name(tag, token))
    collectively(comm, f"creating {tmp}", lambda: _make_dir(tmp, root) if comm.rank == 0 else None)
    try:
        record = collectively(comm, f"writing checkpoint shards to {tmp}", lambda: _write_shard(engine, tmp))
        gathered = comm.all_gather_object(
            {"file": record, "rng": rng.get_rng_state(), "data": data_position(engine)}
        )

        def finish() -> None:
            if comm.rank == 0:
                meta = _metadata(engine, tag, gathered, client_state, exclude_frozen_parameters, tmp)
                write_metadata(os.path.join(tmp, METADATA_FILE), meta)
                fsync_dir(tmp)

        collectively(comm, f"writing {METADATA_FILE} in {tmp}", finish)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = os.path.join(root, tag)
    collectively(
        comm,
        f"publishing {final}",
        lambda: _publish(root, tmp, tag, token, save_latest) if comm.rank == 0 else None,
    )
    if comm.rank == 0:
        logger.info("saved checkpoint %s", final)
    if keep_last is not None:
        collectively(
            comm,
            f"pruning old checkpoints in {root}",
            lambda: _prune(root, tag, keep_last) if comm.rank == 0 else None,
        )
    return final


def _prune(root: str, kept: str, keep_last: int) -> None:
    """Delete the oldest checkpoint directories of ``root`` beyond the newest ``keep_last`` (by the time
    their ``metadata.json`` was written). Only real directories holding a metadata file count; symlinks,
    files, temporary directories, ``kept`` and the target of ``latest`` are never touched."""
    found = []
    for entry in os.scandir(root):
        meta = os.path.join(entry.path, METADATA_FILE)
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False) or not os.path.isfile(meta):
            continue
        found.append((os.stat(meta).st_mtime_ns, entry.name))
    found.sort()
    protected = {kept, read_latest(root)}
    for _, name in found[: max(0, len(found) - keep_last)]:
        if name not in protected:
            shutil.rmtree(os.path.join(root, name))
            logger.info("deleted old checkpoint %s (keep_last=%d)", os.path.join(root, name), keep_last)


def _make_dir(tmp: str, root: str) -> None:
    """Create ``tmp`` (and ``root``); a file where a directory must be is a CheckpointError naming it."""
    existing = root
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise CheckpointError(f"cannot save a checkpoint into {root}: {existing} is a file, not a directory")
    os.makedirs(tmp)


def _agree_on_tag(engine: TrainingState, tag: str) -> str:
    """Every rank must save under one tag; ``checkpoint.tag_validation`` says what a mismatch does."""
    check_tag(tag)
    tags = engine.comm.all_gather_object(tag)
    if len(set(tags)) > 1:
        policy = engine.config.checkpoint.tag_validation
        msg = f"ranks passed different checkpoint tags: {tags}"
        if policy == "FAIL":
            raise ArgumentError(f"{msg} (checkpoint.tag_validation is FAIL)")  # DeepSpeed asserts
        if policy == "WARN" and engine.comm.rank == 0:
            logger.warning("%s; saving under rank 0's tag %r", msg, tags[0])
    return str(tags[0])


def _classify(value: Any, numel: int) -> str:
    if not isinstance(value, torch.Tensor):
        return VALUE
    if value.dim() == 0:
        return SCALAR
    return VECTOR if value.dim() == 1 and value.numel() == numel else FIXED


def _write_shard(engine: TrainingState, directory: str) -> dict[str, Any] | None:
    """Write this rank's pieces of the masters and their optimizer state; None if it owns none."""
    pieces = written_pieces(engine)
    if not pieces:
        return None
    opt = engine.optimizer
    slices = slice_of(engine)
    groups = group_index(opt)
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []
    ranges: list[dict[str, Any]] = []
    for unit, piece in pieces:
        name = unit.names[piece.index]
        check_key_part(name, "parameter name")
        start, end = piece.param_start, piece.param_start + piece.numel
        master = master_view(unit, piece)
        specs.append(TensorSpec(range_key(name, start, end), master.dtype, (piece.numel,)))
        tensors.append(master)
        sl = slices.get((unit.index, piece.index))
        kinds: dict[str, str] = {}
        values: dict[str, Any] = {}
        state = opt.state.get(sl.master, {}) if opt is not None and sl is not None else {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise CheckpointError(f"optimizer state of {name!r} has a non-string key {key!r}")
            check_key_part(key, "optimizer state key")
            kinds[key] = _classify(value, piece.numel)
            if kinds[key] == VALUE:
                values[key] = encode(value, f"optimizer.state[{name}].{key}", {})
            else:
                specs.append(TensorSpec(range_key(name, start, end, key), value.dtype, tuple(value.shape)))
                tensors.append(value)
        group = groups.get(id(sl.master)) if sl is not None else None
        ranges.append(
            {"param": name, "start": start, "end": end, "group": group, "state": kinds, "values": values}
        )
    fname = shard_file_name(engine.comm.rank, engine.comm.world_size)
    record = write_tensors(
        os.path.join(directory, fname),
        specs,
        tensors,
        {"format": "pt", "producer": FORMAT, "rank": str(engine.comm.rank)},
    )
    return {
        "name": fname,
        "bytes": record.nbytes,
        "sha256": record.sha256,
        "rank": engine.comm.rank,
        "ranges": ranges,
    }


def _metadata(
    engine: TrainingState,
    tag: str,
    gathered: list[dict[str, Any]],
    client_state: dict[str, Any] | None,
    exclude_frozen: bool,
    directory: str,
) -> dict[str, Any]:
    """metadata.json's content; writes extra.safetensors (the tensors the JSON refers to) on the way."""
    from zeroshard.version import __version__

    sink: dict[str, torch.Tensor] = {}
    names = module_names(engine.module, engine.units)
    files = {
        g["file"]["name"]: {k: v for k, v in g["file"].items() if k != "name"}
        for g in gathered
        if g["file"] is not None
    }
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "zeroshard_version": __version__,
        "tag": tag,
        "world_size": engine.comm.world_size,
        "stage": engine.plan.stage,
        "master_dtype": dtype_name(engine.units[0].master.dtype if engine.units else torch.float32),
        "parameters": {
            name: {"shape": list(param_shape(unit, i)), "dtype": dtype_name(p.dtype), "unit": unit.index}
            for unit in engine.units
            for i, (name, p) in enumerate(zip(unit.names, unit.params, strict=True))
        },
        "aliases": names.aliases,
        "state_dict_keys": names.state_keys,
        "units": [
            {"names": u.names, "world_size": u.layout.world_size, "padded": u.layout.padded}
            for u in engine.units
        ],
        "files": files,
        "module": _module_entries(engine, names, exclude_frozen, sink),
        "optimizer": _optimizer_meta(engine, files, sink),
        "lr_scheduler": _state_meta(engine.lr_scheduler, "lr_scheduler", sink),
        "loss_scaler": _state_meta(getattr(engine, "loss_scaler", None), "loss_scaler", sink),
        "counters": {
            "global_steps": engine.global_steps,
            "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps,
            "gradient_accumulation_steps": engine.config.gradient_accumulation_steps,
            "train_batch_size": engine.config.train_batch_size,
        },
        "rng": [encode(g["rng"], f"rng/{rank}", sink) for rank, g in enumerate(gathered)],
        "data": _data_meta(gathered),
        "client_state": encode(client_state or {}, "client_state", sink),
        "config": engine.config.to_dict(),
        "hf_config": _hf_config(engine.module),
    }
    write_extra(directory, sink, files)
    return meta


def write_extra(directory: str, sink: dict[str, torch.Tensor], files: dict[str, Any]) -> None:
    """Write the tensors collected in ``sink`` (frozen parameters, buffers, RNG states, client tensors) to
    ``directory``'s extra file and record its size and checksum in ``files`` (metadata.json's file table)."""
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in sink.items()]
    record = write_tensors(
        os.path.join(directory, EXTRA_FILE), specs, list(sink.values()), {"format": "pt", "producer": FORMAT}
    )
    files[EXTRA_FILE] = {"bytes": record.nbytes, "sha256": record.sha256, "rank": None, "ranges": []}


def _module_entries(
    engine: TrainingState, names: Names, exclude_frozen: bool, sink: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """The module's untrained state (frozen parameters, buffers, extra state): tensors into ``sink``."""
    entries: dict[str, Any] = {}
    for key, value in untrained_state(engine.module, names).items():
        if isinstance(value, torch.Tensor):
            if exclude_frozen and isinstance(value, torch.nn.Parameter):
                continue
            sink[f"module/{key}"] = value.detach()
            entries[key] = {"key": f"module/{key}", "dtype": dtype_name(value.dtype)}
            if isinstance(value, torch.nn.Parameter):  # a frozen parameter, not a buffer
                entries[key]["parameter"] = True
        else:
            entries[key] = {"value": encode(value, f"module.{key}", sink)}
    return entries


def _optimizer_meta(engine: TrainingState, files: dict[str, Any], sink: dict[str, torch.Tensor]) -> Any:
    opt = engine.optimizer
    if opt is None:
        return None
    members: list[list[str]] = [[] for _ in opt.param_groups]
    for entry in files.values():
        for r in entry["ranges"]:
            if r["group"] is not None and r["param"] not in members[r["group"]]:
                members[r["group"]].append(r["param"])
    groups = []
    for gi, group in enumerate(opt.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append(
            {"hyperparameters": encode(hyper, f"optimizer/param_groups[{gi}]", sink), "params": members[gi]}
        )
    return {"class": f"{type(opt).__module__}.{type(opt).__qualname__}", "param_groups": groups}


def _state_meta(obj: Any, what: str, sink: dict[str, torch.Tensor]) -> Any:
    if obj is None or not callable(getattr(obj, "state_dict", None)):
        return None
    return {
        "class": f"{type(obj).__module__}.{type(obj).__qualname__}",
        "state": encode(obj.state_dict(), what, sink),
    }


def _data_meta(gathered: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The data loader's position (runtime/data.py [Note: data position]); ranks in lockstep agree."""
    positions = [g["data"] for g in gathered]
    if any(p != positions[0] for p in positions):
        logger.warning(
            "the ranks' data loaders are at different positions %s: saving rank 0's (a resumed run starts "
            "every rank there)",
            positions,
        )
    return positions[0]  # type: ignore[no-any-return]


def _hf_config(module: torch.nn.Module) -> Any:
    """A Hugging Face model's config as a dict, so that an offline conversion can write config.json."""
    to_json = getattr(getattr(module, "config", None), "to_json_string", None)
    if not callable(to_json):
        return None
    import json

    return json.loads(to_json(use_diff=False))


def _publish(root: str, tmp: str, tag: str, token: str, save_latest: bool) -> None:
    """Rename the finished directory into place, then point ``latest`` at it (see [Note: atomic save])."""
    final = os.path.join(root, tag)
    old = None
    if os.path.lexists(final):
        old = os.path.join(root, old_dir_name(tag, token))
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    if save_latest:
        write_latest(root, tag, token)
    for leftover in stale_temp_dirs(root):
        if os.path.isdir(leftover):
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            os.remove(leftover)
