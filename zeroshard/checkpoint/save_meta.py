"""metadata.json's content for a save: parameters, units, file table, module, optimizer, counters, RNG."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint.common import Names, module_names, param_shape, untrained_state
from zeroshard.checkpoint.format import FORMAT, VERSION, encode
from zeroshard.checkpoint.tensorfile import dtype_name

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState

logger = logging.getLogger(__name__)


def build_metadata(
    engine: TrainingState,
    tag: str,
    gathered: list[dict[str, Any]],
    client_state: dict[str, Any] | None,
    exclude_frozen: bool,
    sink: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """metadata.json's content; the tensors it refers to go into ``sink`` (extra.safetensors' content).

    ``gathered`` holds every rank's file entry (its ranges; sizes and checksums are filled in once the file
    is written), RNG state and data position. The file table holds no entry for extra.safetensors yet.
    """
    from zeroshard.version import __version__

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
    return meta


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
