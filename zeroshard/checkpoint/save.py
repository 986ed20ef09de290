"""``save_checkpoint``: every rank writes its shard; rank 0 writes metadata and publishes atomically.

[Note: atomic save]
1. All ranks agree on the tag and a random token; rank 0 creates ``<save_dir>/.<tag>.tmp-<token>/``.
2. Each rank lists its shard's tensors; their ranges, the RNG states and data positions go to every rank
   (``all_gather_object``) and rank 0 builds metadata.json's content (save_meta.py).
3. Each rank writes its shard file there and fsyncs it, hashing the bytes as they are written; rank 0 also
   writes ``extra.safetensors``. A failure on any rank is raised on every rank and the temporary directory
   is removed. (An asynchronous save does this step on a background thread: [Note: async save].)
4. The sizes and sha256 go to rank 0, which writes ``metadata.json``, fsyncs it and the directory.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint import rng
from zeroshard.checkpoint.async_write import CheckpointWriter, PendingSave, Records, named, remove_markers
from zeroshard.checkpoint.common import (
    collectively,
    data_position,
    group_index,
    master_view,
    slice_of,
    written_pieces,
)
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    EXTRA_FILE,
    FORMAT,
    METADATA_FILE,
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
from zeroshard.checkpoint.host_buffers import HostBuffers, SnapshotBuffers
from zeroshard.checkpoint.reader import FIXED, SCALAR, VALUE, VECTOR
from zeroshard.checkpoint.save_meta import build_metadata
from zeroshard.checkpoint.tensorfile import TensorSpec, fsync_dir, write_tensors
from zeroshard.core.comm import Comm
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
    *,
    writer: CheckpointWriter | None = None,
) -> str:
    """Save model, optimizer, scheduler, loss scaler, counters, RNG, the position of the data loader
    ``initialize(training_data=...)`` returned, and client state to ``save_dir/tag``.

    ``keep_last=N`` (opt-in; DeepSpeed keeps every tag) then deletes the oldest checkpoints of ``save_dir``
    beyond the newest ``N``, never the one just written nor the one ``latest`` names.

    With a ``writer`` (whose previous save the caller has published), the save returns once this rank's
    shards are copied to host memory; the writer writes them and :func:`finish_pending` publishes them
    ([Note: async save]).

    See [Note: checkpoint format] and [Note: atomic save]. ``client_state`` may hold JSON values and
    tensors (nothing else: it is never pickled); a script with its own data loader keeps its position
    there.

    Collective: call on all ranks of the engine's group.

    Returns:
        The checkpoint directory (with a ``writer``: where it will be once published).
    """
    _check_keep_last(keep_last)
    comm = engine.comm
    tag = _agree_on_tag(engine, f"global_step{engine.global_steps}" if tag is None else str(tag))
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
    root = os.path.abspath(os.fspath(save_dir))
    tmp = os.path.join(root, temp_dir_name(tag, token))
    collectively(comm, f"creating {tmp}", lambda: _make_dir(tmp, root) if comm.rank == 0 else None)
    save = PendingSave(root, tmp, tag, token, save_latest, keep_last, meta=None)
    # Training changes the shards while the writer works: it needs copies ([Note: host snapshot buffers]).
    host = writer.host if writer is not None else None
    try:
        entry, shard = collectively(
            comm,
            f"copying checkpoint shards for {tmp}",
            lambda: _shard(engine, None if host is None else host.shard),
        )
        gathered = comm.all_gather_object(
            {"file": entry, "rng": rng.get_rng_state(), "data": data_position(engine)}
        )
        extra = collectively(
            comm,
            f"describing the checkpoint in {tmp}",
            lambda: _describe(engine, save, gathered, client_state, exclude_frozen_parameters, host),
        )
        job = _Files(tmp, comm.rank, shard, extra)
        if writer is not None:
            writer.submit(save, lambda: _write_files(job, background=True))
            return os.path.join(root, tag)
        records = collectively(comm, f"writing checkpoint files to {tmp}", lambda: _write_files(job))
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(comm, save, records)


def _check_keep_last(keep_last: object) -> None:
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(f"save_checkpoint(keep_last={keep_last!r}): expected None or an int >= 1")


def _describe(
    engine: TrainingState,
    save: PendingSave,
    gathered: list[dict[str, Any]],
    client_state: dict[str, Any] | None,
    exclude_frozen: bool,
    host: SnapshotBuffers | None,
) -> dict[str, torch.Tensor] | None:
    """Rank 0: build metadata.json's content into ``save.meta``; the tensors it refers to (extra.safetensors'
    content), copied into ``host`` when given. None on the other ranks."""
    if engine.comm.rank != 0:
        return None
    sink: dict[str, torch.Tensor] = {}
    save.meta = build_metadata(engine, save.tag, gathered, client_state, exclude_frozen, sink)
    if host is None:
        return sink
    return dict(zip(sink, host.extra.copy(list(sink.values())), strict=True))


def finish_pending(comm: Comm, writer: CheckpointWriter) -> str | None:
    """Wait for ``writer``'s pending save on every rank, then publish it; None if there is none.

    A failure of the background write on any rank raises on every rank (naming the rank and the file) and
    removes the temporary directory; ``latest`` still names the previous checkpoint.

    Collective: call on all ranks of the engine's group.
    """
    save = writer.take_pending()
    if save is None:
        return None
    try:
        records = collectively(comm, f"writing checkpoint files to {save.tmp}", save.result.result)
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(save.tmp, ignore_errors=True)
        raise
    return _commit(comm, save, records)


def finish_at_exit(writer: CheckpointWriter) -> None:
    """Publish ``writer``'s pending save without a collective (destroy, exit): see [Note: async save], 4."""
    save = writer.pending
    records = writer.close()
    if records is None or save is None or save.meta is None:
        return
    _write_meta(save, [records])
    _publish(save.root, save.tmp, save.tag, save.token, save.save_latest)
    if save.keep_last is not None:
        _prune(save.root, save.tag, save.keep_last)
    logger.info("saved checkpoint %s at exit", os.path.join(save.root, save.tag))


def _commit(comm: Comm, save: PendingSave, records: Records) -> str:
    """Gather every rank's file records, write metadata.json and publish. Collective."""
    gathered = comm.all_gather_object(records)
    try:
        collectively(
            comm,
            f"writing {METADATA_FILE} in {save.tmp}",
            lambda: _write_meta(save, gathered) if comm.rank == 0 else None,
        )
    except BaseException:
        if comm.rank == 0:
            shutil.rmtree(save.tmp, ignore_errors=True)
        raise
    root, tag = save.root, save.tag
    final = os.path.join(root, tag)
    collectively(
        comm,
        f"publishing {final}",
        lambda: _publish(root, save.tmp, tag, save.token, save.save_latest) if comm.rank == 0 else None,
    )
    if comm.rank == 0:
        logger.info("saved checkpoint %s", final)
    keep_last = save.keep_last
    if keep_last is not None:
        collectively(
            comm,
            f"pruning old checkpoints in {root}",
            lambda: _prune(root, tag, keep_last) if comm.rank == 0 else None,
        )
    return final


def _write_meta(save: PendingSave, gathered: list[Records]) -> None:
    """Rank 0: complete the file table with every rank's sizes and checksums, write metadata.json."""
    if save.meta is None:
        raise RuntimeError(f"rank 0: checkpoint save: no metadata was built for {save.tmp}")
    files = save.meta["files"]
    for records in gathered:
        for name, record in records.items():
            files.setdefault(name, {}).update(record)
    remove_markers(save.tmp)
    write_metadata(os.path.join(save.tmp, METADATA_FILE), save.meta)
    fsync_dir(save.tmp)


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


@dataclass(frozen=True)
class _Files:
    """This rank's files of one save, ready to write: its shard (name, specs, tensors), rank 0's extra."""

    tmp: str
    rank: int
    shard: tuple[str, list[TensorSpec], list[torch.Tensor]] | None
    extra: dict[str, torch.Tensor] | None


def _write_files(job: _Files, background: bool = False) -> Records:
    """Write and fsync ``job``'s files; their sizes and checksums. In the background, errors name the file."""
    records: Records = {}
    path = job.tmp
    try:
        if job.shard is not None:
            name, specs, tensors = job.shard
            path = os.path.join(job.tmp, name)
            meta = {"format": "pt", "producer": FORMAT, "rank": str(job.rank)}
            record = write_tensors(path, specs, tensors, meta)
            records[name] = {"bytes": record.nbytes, "sha256": record.sha256}
        if job.extra is not None:
            path = os.path.join(job.tmp, EXTRA_FILE)
            write_extra(job.tmp, job.extra, records)
    except Exception as err:
        if background:
            raise named(path, err) from err
        raise
    return records


def _shard(engine: TrainingState, host: HostBuffers | None) -> tuple[dict[str, Any] | None, Any]:
    """This rank's file-table entry (sizes and checksums to come) and its shard's (name, specs, tensors):
    its pieces of the masters and their optimizer state, the tensors themselves or (``host``) copies of
    them in its buffer; (None, None) if it owns none."""
    pieces = written_pieces(engine)
    if not pieces:
        return None, None
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
    if host is not None:
        tensors = host.copy(tensors)
    fname = shard_file_name(engine.comm.rank, engine.comm.world_size)
    entry = {"name": fname, "bytes": 0, "sha256": "", "rank": engine.comm.rank, "ranges": ranges}
    return entry, (fname, specs, tensors)


def write_extra(directory: str, sink: dict[str, torch.Tensor], files: dict[str, Any]) -> None:
    """Write the tensors collected in ``sink`` (frozen parameters, buffers, RNG states, client tensors) to
    ``directory``'s extra file and record its size and checksum in ``files`` (metadata.json's file table)."""
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in sink.items()]
    record = write_tensors(
        os.path.join(directory, EXTRA_FILE), specs, list(sink.values()), {"format": "pt", "producer": FORMAT}
    )
    files[EXTRA_FILE] = {"bytes": record.nbytes, "sha256": record.sha256, "rank": None, "ranges": []}


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
