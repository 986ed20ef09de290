"""The way back: any checkpoint zeroshard reads, written in DeepSpeed's ZeRO layout for a chosen world size.

The output is what DeepSpeed 0.19.8's ``engine.save_checkpoint`` writes (deepspeed/reader.py
[Note: DeepSpeed checkpoint layout]), so DeepSpeed's ``load_checkpoint`` at that world size and stage, and
its ``zero_to_fp32.py``, read it. DeepSpeed rebuilds its flat groups from the model it is given: the file
must list each param group's parameters in the order DeepSpeed's optimizer holds them, which is the order
of ``model_parameters`` (or of the param group dicts) passed to ``deepspeed.initialize``. The writer uses
each saved param group's own order (zeroshard records it), else the module's parameter order.

Written one rank at a time: memory holds one rank's flat partition (and its optimizer state), never the
whole model's optimizer state. DeepSpeed's pickled classes (its loss scaler; the ZeRO stage enum is
written as a plain int) are written by name through a pickler that never imports DeepSpeed
(``pickles.save_pickle``).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint.deepspeed.pickles import deepspeed_loss_scaler, save_pickle
from zeroshard.checkpoint.deepspeed.reader import MODEL_FILE, AnyReader, DeepSpeedReader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.reader import VECTOR

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState

logger = logging.getLogger(__name__)

DS_VERSION = "0.19.8"  # the DeepSpeed release whose layout this writes


def _compute_dtype(config: Mapping[str, Any]) -> torch.dtype:
    def enabled(key: str) -> bool:
        section = config.get(key)
        return isinstance(section, Mapping) and bool(section.get("enabled", False))

    if enabled("bf16") or enabled("bfloat16"):
        return torch.bfloat16
    return torch.float16 if enabled("fp16") else torch.float32


def _groups(reader: AnyReader) -> list[list[str]]:
    """Each param group's trained parameters, in the order the saved optimizer held them."""
    saved = (reader.meta.get("optimizer") or {}).get("param_groups") or [{}]
    order = list(reader.params)
    groups: list[list[str]] = []
    for gi, group in enumerate(saved):
        listed = group.get("params")
        if isinstance(listed, list) and listed:
            groups.append([str(n) for n in listed if n in reader.params])
        else:
            groups.append([n for n in order if {r.group for r in reader.ranges[n]} <= {gi, None}])
    placed = {n for g in groups for n in g}
    if placed != set(order):
        missing = [n for n in order if n not in placed]
        raise CheckpointError(f"{reader.path}: parameters {missing} are in no param group of the optimizer")
    return groups


def _hyper(reader: AnyReader, gi: int) -> dict[str, Any]:
    saved = (reader.meta.get("optimizer") or {}).get("param_groups") or []
    if gi >= len(saved):
        return {}
    return dict(reader.decode(saved[gi].get("hyperparameters", {})))


class _Source:
    """Reads a run of parameters' elements (or one optimizer state of them) into a flat buffer."""

    def __init__(self, reader: AnyReader, names: list[str]) -> None:
        self.reader = reader
        self.names = names
        self.numels = [reader.numel(n) for n in names]
        first = names[0] if names else None
        full = (0, self.numels[0]) if names else (0, 0)
        self.states = reader.range_states(first, *full) if first is not None else {}
        self.vectors = [k for k, kind in self.states.items() if kind == VECTOR]
        self.scalars = {
            k: torch.as_tensor(reader.read_state(first, *full, k), dtype=torch.float32)
            for k, kind in self.states.items()
            if kind != VECTOR and first is not None
        }

    def fill(self, out: torch.Tensor, spans: list[tuple[int, int, int, int]], state: str | None) -> None:
        """``spans``: (parameter index, start, end, offset in ``out``). A parameter the optimizer never
        stepped has no state: its elements stay as they are (zeros, as DeepSpeed's would be)."""
        for i, start, end, at in spans:
            name = self.names[i]
            if state is not None and state not in self.reader.range_states(name, start, end):
                continue
            self.reader.read_range(name, start, end, out=out[at : at + end - start], state=state)


def _write_stage12(
    reader: AnyReader, out: str, world_size: int, stage: int, groups: list[list[str]], common: dict[str, Any]
) -> None:
    prefix = "bf16_" if common["dtype"] == torch.bfloat16 else ""
    sources = [_Source(reader, g) for g in groups]
    for rank in range(world_size):
        fp32, paddings, states, param_groups = [], [], {}, []
        for gi, src in enumerate(sources):
            total = sum(src.numels)
            align = 2 * world_size
            part = math.ceil(total / align) * align // world_size
            lo, hi = rank * part, min((rank + 1) * part, total)
            lean = max(hi - lo, 0)
            if rank < world_size - 1 and lean < part:
                raise CheckpointError(
                    f"param group {gi} has {total} elements: too few to split over {world_size} ranks in "
                    "DeepSpeed's layout (its padding would reach past the last rank)"
                )
            spans, at = [], 0
            for i, n in enumerate(src.numels):
                a, b = max(lo, at), min(hi, at + n)
                if a < b:
                    spans.append((i, a - at, b - at, a - lo))
                at += n
            master = torch.zeros(lean)
            src.fill(master, spans, None)
            fp32.append(master)
            paddings.append(part - lean)
            state: dict[str, torch.Tensor] = {k: v.clone() for k, v in src.scalars.items()}
            for key in src.vectors:
                state[key] = torch.zeros(part)
                src.fill(state[key], spans, key)
            states[gi] = state
            param_groups.append({**_hyper(reader, gi), "params": [gi]})
        optimizer_state = {
            "loss_scaler": common["loss_scaler"],
            "dynamic_loss_scale": common["loss_scaler"].get("dynamic", False),
            "overflow": False,
            "clip_grad": float(common["config"].get("gradient_clipping", 0.0) or 0.0),
            "base_optimizer_state": {"state": states, "param_groups": param_groups},
            "single_partition_of_fp32_groups": fp32,
            "zero_stage": stage,
            "group_paddings": paddings,
            "partition_count": [world_size] * len(groups),
            "ds_version": DS_VERSION,
        }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        save_pickle(_optim_file(optimizer_state, common), os.path.join(out, name))
        if isinstance(reader, DeepSpeedReader):
            reader.close()  # the source's rank files: one at a time


def _optim_file(optimizer_state: dict[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    return {"optimizer_state_dict": optimizer_state, "ds_config": common["config"], "ds_version": DS_VERSION}


def _write_stage3(
    reader: AnyReader, out: str, world_size: int, groups: list[list[str]], common: dict[str, Any]
) -> None:
    prefix = "bf16_" if common["dtype"] == torch.bfloat16 else ""
    sources = [_Source(reader, g) for g in groups]
    for rank in range(world_size):
        fp32, states, param_groups = [], {}, []
        for gi, src in enumerate(sources):
            spans, at = [], 0
            for i, n in enumerate(src.numels):
                chunk = math.ceil(n / world_size)
                a, b = min(rank * chunk, n), min((rank + 1) * chunk, n)
                if a < b:
                    spans.append((i, a, b, at))
                at += chunk
            master = torch.zeros(at)
            src.fill(master, spans, None)
            fp32.append(master)
            state: dict[str, torch.Tensor] = {k: v.clone() for k, v in src.scalars.items()}
            for key in src.vectors:
                state[key] = torch.zeros(at)
                src.fill(state[key], spans, key)
            states[gi] = state
            param_groups.append({**_hyper(reader, gi), "params": [gi]})
        optimizer_state = {
            "zero_stage": 3,
            "loss_scaler": common["loss_scaler"],
            "dynamic_loss_scale": common["loss_scaler"].get("dynamic", False),
            "overflow": False,
            "partition_count": world_size,
            "optimizer_state_dict": {"state": states, "param_groups": param_groups},
            "fp32_flat_groups": fp32,
        }
        name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        save_pickle(_optim_file(optimizer_state, common), os.path.join(out, name))
        model = dict(common["model_states"])
        model["module"] = _module(reader, common, placeholders=True)
        model["frozen_param_fragments"] = OrderedDict(
            (key, _chunk(reader.read_full(key, dtype=common["dtype"]).reshape(-1), rank, world_size))
            for key in common["frozen"]
        )
        save_pickle(model, os.path.join(out, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"))
        if isinstance(reader, DeepSpeedReader):
            reader.close()


def _chunk(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = math.ceil(flat.numel() / world_size)
    piece = flat[rank * size : (rank + 1) * size].clone()
    return torch.cat([piece, piece.new_zeros(size - piece.numel())])


def _module(reader: AnyReader, common: dict[str, Any], placeholders: bool) -> OrderedDict[str, torch.Tensor]:
    """The module's state dict as DeepSpeed saves it: the compute dtype, tied names sharing a tensor; at
    stage 3 parameters are empty placeholders and only buffers hold values."""
    dtype = common["dtype"]
    module: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key in common["keys"]:
        stored = reader.canonical(key)
        if stored is None:
            continue
        is_param = stored in reader.params or stored in common["frozen"]
        if placeholders and is_param:
            module[key] = torch.empty(0, dtype=dtype)
        elif key != stored and stored in module:
            module[key] = module[stored]
        else:
            want = dtype if reader.stored_dtype(stored).is_floating_point else None
            module[key] = reader.read_full(stored, dtype=want)
    return module


def write_deepspeed_checkpoint(
    reader: AnyReader,
    save_dir: str | os.PathLike[str],
    *,
    world_size: int,
    stage: int,
    tag: str | None = None,
    save_latest: bool = True,
) -> str:
    """Write ``reader``'s checkpoint to ``save_dir/<tag>`` in DeepSpeed's ZeRO layout for ``world_size``
    ranks at ``stage`` (1, 2 or 3), and point ``save_dir/latest`` at it.

    ``tag`` defaults to DeepSpeed's ``global_step<N>``. Returns the checkpoint directory.

    Raises:
        ValueError: ``world_size`` or ``stage`` out of range.
        CheckpointError: the checkpoint cannot be laid out (a parameter in no param group).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected a positive int")
    if stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r}: DeepSpeed ZeRO checkpoints have stage 1, 2 or 3")
    meta = reader.meta
    counters = {k: int((meta.get("counters") or {}).get(k) or 0) for k in ("global_steps", "global_samples")}
    counters["skipped_steps"] = int((meta.get("counters") or {}).get("skipped_steps") or 0)
    tag = tag if tag is not None else f"global_step{counters['global_steps']}"
    root = os.fspath(save_dir)
    out = os.path.join(root, tag)
    os.makedirs(out, exist_ok=True)
    config = dict(reader.decode(meta.get("ds_config") or meta.get("config") or {}))
    groups = _groups(reader)
    keys = [
        k
        for k in (meta.get("state_dict_keys") or [*reader.params, *reader.module_extra])
        if isinstance(k, str)
    ]
    frozen = [k for k, e in reader.module_extra.items() if e.get("parameter") and "key" in e]
    buffers = [k for k, e in reader.module_extra.items() if not e.get("parameter") and "key" in e]
    scaler = meta.get("loss_scaler")
    sched = meta.get("lr_scheduler")
    client = reader.decode(meta.get("client_state") or {})
    common: dict[str, Any] = {
        "dtype": _compute_dtype(config),
        "config": config,
        "keys": keys,
        "frozen": frozen if stage == 3 else [],
        "loss_scaler": deepspeed_loss_scaler(None if scaler is None else reader.decode(scaler["state"])),
    }
    model_states: dict[str, Any] = {
        "buffer_names": buffers,
        "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(reader.shape(n))) for n in g) for g in groups],
        "frozen_param_shapes": OrderedDict((k, torch.Size(reader.shape(k))) for k in frozen)
        if stage == 3
        else None,
        "shared_params": {a: t for a, t in reader.aliases.items() if t in reader.params},
        "frozen_param_fragments": None,
        "lr_scheduler": None if sched is None else reader.decode(sched["state"]),
        "data_sampler": None,
        "random_ltd": None,
        **counters,
        "dp_world_size": world_size,
        "mp_world_size": 1,
        "ds_config": config,
        "ds_version": DS_VERSION,
        **(client if isinstance(client, dict) else {"client_state": client}),
    }
    common["model_states"] = model_states
    if stage == 3:
        _write_stage3(reader, out, world_size, groups, common)
    else:
        model = {"module": _module(reader, common, placeholders=False), **model_states}
        save_pickle(model, os.path.join(out, MODEL_FILE))
        _write_stage12(reader, out, world_size, stage, groups, common)
    if save_latest:
        latest = os.path.join(root, "latest")
        with open(f"{latest}.tmp", "w", encoding="utf-8") as f:
            f.write(tag)
        os.replace(f"{latest}.tmp", latest)
    logger.info("wrote DeepSpeed ZeRO-%d checkpoint %s for %d ranks", stage, out, world_size)
    return out


def save_as_deepspeed(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> str:
    """``engine.save_checkpoint(..., format="deepspeed")``: the engine's state as a DeepSpeed checkpoint
    for its world size and stage (1-3), so that DeepSpeed resumes it on the same number of ranks.

    zeroshard's own checkpoint is written first to a hidden directory in ``save_dir`` (so the disk briefly
    holds both), then the first rank lays it out for DeepSpeed and removes it.

    Collective: call on all ranks of the engine's group.

    Raises:
        ValueError: the engine runs at stage 0 (DeepSpeed's stage-0 layout is not written).
    """
    from zeroshard.checkpoint.common import collectively
    from zeroshard.checkpoint.reader import CheckpointReader
    from zeroshard.checkpoint.save import save_checkpoint

    stage, comm = engine.plan.stage, engine.comm
    if stage not in (1, 2, 3):
        raise ValueError(
            f"save_checkpoint(format='deepspeed') at stage {stage}: DeepSpeed ZeRO checkpoints are written "
            "for stages 1-3; save in zeroshard's format and run `zeroshard convert --to deepspeed --stage N`"
        )
    token = comm.all_gather_object(uuid.uuid4().hex[:12])[0]
    staging = os.path.join(os.fspath(save_dir), f".zeroshard-for-deepspeed-{token}")
    path = save_checkpoint(engine, staging, tag, client_state, False, exclude_frozen_parameters)

    def convert() -> str:
        if comm.rank != 0:
            return ""
        try:
            with CheckpointReader(path) as reader:
                return write_deepspeed_checkpoint(
                    reader,
                    save_dir,
                    world_size=comm.world_size,
                    stage=stage,
                    tag=os.path.basename(path),
                    save_latest=save_latest,
                )
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    out = collectively(comm, f"writing the DeepSpeed checkpoint in {save_dir}", convert)
    return os.path.join(os.fspath(save_dir), os.path.basename(path)) if not out else out
