"""``initialize``'s check that every rank built the same model and resolved the same config.

DDP compares parameter shapes across ranks when it is constructed; without such a check, ranks that built
different models (another layer count, a different config file per node) meet in the first reduce-scatter
with buffers of different sizes and hang until the collective timeout, and ranks with different learning
rates train silently, each shard at its own rate. Here every rank hashes a description of its model (the
name, full shape, dtype and trainability of every parameter, the name, shape and dtype of every buffer) and
of its resolved config; one tiny bounded all-gather compares the hashes. Only when they differ are the
descriptions themselves exchanged, to name the first difference and the ranks that disagree. Config keys
naming where files go (``*path``, monitor job names) may differ per node and are left out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.core.comm import Comm
from zeroshard.core.partitioned import full_shape

__all__ = ["check_ranks_agree"]

_PER_NODE = {"job_name", "project", "group", "team"}


def _model_lines(model: nn.Module) -> list[str]:
    lines = [
        f"parameter {name}: shape {tuple(full_shape(p))}, {p.dtype}, requires_grad={p.requires_grad}"
        for name, p in model.named_parameters()
    ]
    lines += [f"buffer {name}: shape {tuple(b.shape)}, {b.dtype}" for name, b in model.named_buffers()]
    return lines


def _config_lines(cfg: ZeroshardConfig, prefix: str = "") -> list[str]:
    def walk(value: Any, key: str) -> list[str]:
        if isinstance(value, dict):
            return [line for k in sorted(value) for line in walk(value[k], f"{key}.{k}" if key else str(k))]
        last = key.rsplit(".", 1)[-1]
        if "path" in last or last in _PER_NODE:
            return []  # where files go may differ per node (local NVMe, per-node log directories)
        text = json.dumps(value, default=repr, sort_keys=True)
        # Objects a dict config may carry print with their address, which differs per process by design.
        return [] if " at 0x" in text else [f"config {key} = {text}"]

    return walk(cfg.to_dict(), prefix)


def _digest(lines: list[str]) -> list[int]:
    raw = hashlib.sha256("\n".join(lines).encode()).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]


def check_ranks_agree(model: nn.Module, cfg: ZeroshardConfig, comm: Comm) -> None:
    """Raise ``ValueError`` on every rank if some rank built another model or resolved another config,
    naming the first difference and the ranks on each side. Collective: call on all ranks."""
    if comm.world_size == 1:
        return
    parts = {"model": _model_lines(model), "config": _config_lines(cfg)}
    mine = _digest(parts["model"]) + _digest(parts["config"])
    rows = comm.agree_async(mine, what="initialize: model and config agreement").result()
    if all(row == rows[0] for row in rows):
        return
    everyone = comm.all_gather_object(parts)
    for what in ("model", "config"):
        sides = [everyone[r][what] for r in range(comm.world_size)]
        if all(side == sides[0] for side in sides):
            continue
        other = next(r for r in range(comm.world_size) if sides[r] != sides[0])
        same = [r for r in range(comm.world_size) if sides[r] == sides[0]]
        differ = [r for r in range(comm.world_size) if sides[r] != sides[0]]
        first, theirs = sides[0], sides[other]
        ours_only = [line for line in first if line not in set(theirs)][:4]
        theirs_only = [line for line in theirs if line not in set(first)][:4]
        raise ValueError(
            f"initialize(): the ranks did not build the same {what}: ranks {same} have "
            f"{'; '.join(ours_only) or '(nothing more)'} where ranks {differ} have "
            f"{'; '.join(theirs_only) or '(nothing more)'}. Every rank must build the same model and read "
            "the same config."
        )
