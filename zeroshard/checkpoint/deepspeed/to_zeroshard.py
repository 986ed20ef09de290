"""A DeepSpeed checkpoint rewritten in zeroshard's own format, offline, one DeepSpeed file at a time.

``engine.load_checkpoint`` reads DeepSpeed checkpoints directly; this is for keeping the converted copy:
checksummed, pickle-free, and readable without ever opening DeepSpeed's pickles again. The saved ranges
are DeepSpeed's own partitions (each DeepSpeed rank file becomes one shard file holding the same
elements), so memory holds one rank file's tensors at a time; zeroshard reshards them on load like any of
its checkpoints (checkpoint/format.py [Note: checkpoint format]).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed.reader import DeepSpeedReader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import (
    FORMAT,
    METADATA_FILE,
    VERSION,
    check_key_part,
    check_tag,
    encode,
    range_key,
    shard_file_name,
    temp_dir_name,
    write_latest,
    write_metadata,
)
from zeroshard.checkpoint.reader import SCALAR, VECTOR
from zeroshard.checkpoint.save import write_extra
from zeroshard.checkpoint.tensorfile import TensorSpec, fsync_dir, write_tensors


def _shard(reader: DeepSpeedReader, fname: str, index: int, count: int, out: str) -> dict[str, Any]:
    """Write the ranges DeepSpeed's ``fname`` holds as zeroshard shard ``index`` of ``count``."""
    specs: list[TensorSpec] = []
    reads: list[tuple[str, int, int, str | None]] = []
    ranges: list[dict[str, Any]] = []
    for name, saved in reader.ranges.items():
        check_key_part(name, "parameter name")
        for r in saved:
            if r.file != fname:
                continue
            specs.append(TensorSpec(range_key(name, r.start, r.end), torch.float32, (r.end - r.start,)))
            reads.append((name, r.start, r.end, None))
            for key, kind in r.states.items():
                check_key_part(key, "optimizer state key")
                shape = (r.end - r.start,) if kind == VECTOR else ()
                specs.append(TensorSpec(range_key(name, r.start, r.end, key), torch.float32, shape))
                reads.append((name, r.start, r.end, key))
            ranges.append(
                {"param": name, "start": r.start, "end": r.end, "group": r.group, "state": dict(r.states)}
            )

    def tensors() -> Iterator[torch.Tensor]:
        for name, start, end, key in reads:
            if key is None:
                yield reader.read_range(name, start, end)
            elif reader.range_states(name, start, end)[key] == SCALAR:
                yield torch.as_tensor(reader.read_state(name, start, end, key), dtype=torch.float32).reshape(
                    ()
                )
            else:
                yield reader.read_range(name, start, end, state=key).float()

    shard = shard_file_name(index, count)
    record = write_tensors(os.path.join(out, shard), specs, tensors(), {"format": "pt", "producer": FORMAT})
    reader.release([fname])
    return {shard: {"bytes": record.nbytes, "sha256": record.sha256, "rank": index, "ranges": ranges}}


def _metadata(reader: DeepSpeedReader, tag: str, files: dict[str, Any], out: str) -> dict[str, Any]:
    """metadata.json's content; writes extra.safetensors (the tensors it refers to) on the way."""
    from zeroshard.version import __version__

    meta = reader.meta
    sink: dict[str, torch.Tensor] = {}
    module: dict[str, Any] = {}
    for key, entry in reader.module_extra.items():
        sink[f"module/{key}"] = reader.read_full(key).contiguous()
        module[key] = {"key": f"module/{key}", "dtype": entry["dtype"]}
        if entry.get("parameter"):
            module[key]["parameter"] = True
    groups = [
        {
            "hyperparameters": encode(g["hyperparameters"], f"optimizer/param_groups[{gi}]", sink),
            "params": g["params"],
        }
        for gi, g in enumerate(meta["optimizer"]["param_groups"])
    ]
    sched, scaler = meta.get("lr_scheduler"), meta.get("loss_scaler")
    config = meta.get("ds_config") or {}
    counters = dict(meta["counters"])
    counters["micro_steps"] = counters["global_steps"] * int(
        config.get("gradient_accumulation_steps", 1) or 1
    )
    result: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "zeroshard_version": __version__,
        "tag": tag,
        "world_size": reader.world_size,
        "stage": reader.stage,
        "master_dtype": "float32",
        "parameters": {n: {"shape": list(p["shape"])} for n, p in reader.params.items()},
        "aliases": dict(reader.aliases),
        "state_dict_keys": meta["state_dict_keys"],
        "files": files,
        "module": module,
        "optimizer": {"class": "deepspeed", "param_groups": groups},
        "lr_scheduler": None
        if sched is None
        else {"class": "deepspeed", "state": encode(sched["state"], "lr_scheduler", sink)},
        "loss_scaler": None
        if scaler is None
        else {"class": "deepspeed", "state": encode(scaler["state"], "loss_scaler", sink)},
        "counters": counters,
        "rng": None,  # DeepSpeed saves none
        "data": None,
        "client_state": encode(meta.get("client_state") or {}, "client_state", sink),
        "config": encode(config, "config", sink),
        "hf_config": None,
        "converted_from": {"format": "deepspeed", "path": reader.path},
    }
    write_extra(out, sink, files)
    return result


def write_zeroshard_checkpoint(
    reader: DeepSpeedReader, save_dir: str | os.PathLike[str], tag: str | None = None
) -> str:
    """Write DeepSpeed checkpoint ``reader`` as a zeroshard checkpoint ``save_dir/<tag>`` (default
    DeepSpeed's own tag) and point ``save_dir/latest`` at it. Returns the checkpoint directory.

    Raises:
        CheckpointError: a name zeroshard's format cannot hold (one with ``|``), or a write failed.
    """
    tag = tag if tag is not None else os.path.basename(os.path.normpath(reader.path))
    check_tag(tag)
    root = os.path.abspath(os.fspath(save_dir))
    token = uuid.uuid4().hex[:12]
    tmp = os.path.join(root, temp_dir_name(tag, token))
    os.makedirs(tmp)
    try:
        used = {r.file for ranges in reader.ranges.values() for r in ranges}
        sources = [f for f in reader.optim_files if f in used] or sorted(used)
        files: dict[str, Any] = {}
        for i, fname in enumerate(sources):
            files.update(_shard(reader, fname, i, len(sources), tmp))
        write_metadata(os.path.join(tmp, METADATA_FILE), _metadata(reader, tag, files, tmp))
        fsync_dir(tmp)
        final = os.path.join(root, tag)
        if os.path.lexists(final):
            raise CheckpointError(
                f"{final} already exists: convert into another directory or pass another tag"
            )
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_latest(root, tag, token)
    return final
