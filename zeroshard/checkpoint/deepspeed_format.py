"""DeepSpeed ZeRO checkpoints, read as any-range tensors so zeroshard's own loader reshards them.

[Note: DeepSpeed checkpoint layout]
``<save_dir>/latest`` names a tag; ``<save_dir>/<tag>/`` holds

* ``mp_rank_00_model_states.pt`` (stages 0-2) or ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (stage 3,
  one per rank): the module's state dict in the compute dtype (stage 3: empty placeholders), the trained
  parameters' names and shapes per param group in flat order (``param_shapes``), tied names
  (``shared_params``, on rank 0), frozen parameters (stage 3: ``frozen_param_fragments``, each rank's
  ``ceil(numel / W)`` elements), the scheduler's state, counters and the client state's keys.
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, one per rank R of W: ``optimizer_state_dict``
  with the fp32 masters and the torch optimizer's state of the flat tensors this rank steps.

  - Stages 1 and 2: per param group, the group's parameters flattened in ``param_shapes`` order (with
    ``param_alignment_paddings`` after each) and cut into W consecutive partitions; rank R saves its
    partition without the trailing padding (``single_partition_of_fp32_groups``) and Adam's moments of
    the same partition, padding included.
  - Stage 3: every parameter is cut on its own into W chunks of ``ceil(numel / W)``; rank R's flat group
    is its chunk of each parameter, in order (``fp32_flat_groups``), and the moments are laid out alike.

:class:`DeepSpeedReader` turns this into what :class:`~zeroshard.checkpoint.reader.CheckpointReader`
offers (saved ranges per parameter, read by element range), so ``load_checkpoint``, the offline
conversions and the state-dict helpers use it unchanged. Files are unpickled only as
deepspeed_pickle.py [Note: DeepSpeed pickles] allows, memory-mapped, one at a time where a caller
releases them.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any, TypeAlias

import torch

from zeroshard.checkpoint.deepspeed_pickle import DeepSpeedObject, load_deepspeed_file
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import METADATA_FILE, confined, read_latest
from zeroshard.checkpoint.reader import SCALAR, VECTOR, CheckpointReader

logger = logging.getLogger(__name__)

MODEL_FILE = "mp_rank_00_model_states.pt"
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
# Keys of the model-states file that are DeepSpeed's own; every other key is client state.
_ENGINE_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
        "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
        "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
        "checkpoint_parallel_dimensions", "universal_checkpoint_info", "sparse_tensor_module_names",
        "iteration",
    }
)  # fmt: skip


def is_deepspeed_checkpoint(path: str) -> bool:
    """Whether ``path`` is one DeepSpeed checkpoint (a tag's directory with its model states file)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return MODEL_FILE in names or any(_ZERO3_MODEL_RE.match(n) for n in names)


def resolve_deepspeed(load_dir: str, tag: str | None) -> str | None:
    """The DeepSpeed checkpoint directory of ``tag`` (default: ``latest``'s) in ``load_dir``, or None when
    ``load_dir`` is not a DeepSpeed save directory (or checkpoint) at all."""
    if tag is None and is_deepspeed_checkpoint(load_dir):
        return load_dir
    name = tag if tag is not None else read_latest(load_dir)
    if name is None:
        return None
    path = confined(load_dir, name, "tag=" if tag is not None else os.path.join(load_dir, "latest"))
    return path if is_deepspeed_checkpoint(path) else None


@dataclass(frozen=True)
class DeepSpeedRange:
    """Elements ``[start, end)`` of one parameter, held by rank file ``file`` in its flat group ``flat``
    (the fp32 master and each optimizer state tensor) from element ``offset`` of that flat tensor;
    ``group`` is the param group of the optimizer it belongs to."""

    file: str
    start: int
    end: int
    group: int | None
    flat: int
    offset: int
    states: dict[str, str] = field(default_factory=dict)


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{what} is {value!r}, not a non-negative integer")
    return int(value)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)):
        raise CheckpointError(f"{what} is a {type(value).__name__}, not a shape")
    return tuple(_int(d, what) for d in value)


class DeepSpeedReader:
    """One DeepSpeed ZeRO checkpoint (stages 1-3), with :class:`CheckpointReader`'s reading interface.

    Invariant (checked on open): for every trained parameter the ranges the rank files hold tile
    ``[0, numel)`` exactly, and every flat tensor is long enough for the ranges read from it.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._cache: dict[str, Any] = {}
        names = os.listdir(path)
        optim = {int(m.group(2)): n for n in names if (m := _OPTIM_RE.match(n))}
        if not optim:
            raise CheckpointError(
                f"{path} holds no *zero_pp_rank_*_optim_states.pt files: only DeepSpeed ZeRO checkpoints "
                "(stages 1-3) are read; a stage-0 checkpoint holds a whole-model optimizer state zeroshard "
                "does not map to parameters"
            )
        self.world_size = len(optim)
        if sorted(optim) != list(range(self.world_size)):
            raise CheckpointError(f"{path}: the optimizer files are for ranks {sorted(optim)}, not 0..W-1")
        self.optim_files = [optim[r] for r in range(self.world_size)]
        model_name = MODEL_FILE if MODEL_FILE in names else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        self.model_states: dict[str, Any] = self._checked_dict(model_name)
        first = self._optimizer_state(self.optim_files[0])
        self.stage = int(first.get("zero_stage", 0))
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"{path}/{self.optim_files[0]}: zero_stage {self.stage!r} is not 1, 2 or 3")
        self.params: dict[str, dict[str, Any]] = {}
        self.ranges: dict[str, list[DeepSpeedRange]] = {}
        self._param_groups: list[dict[str, Any]] = []
        self._step: dict[tuple[str, int], torch.Tensor] = {}
        self._moment_keys: list[str] = []
        if self.stage == 3:
            self._index_stage3()
            self._merge_sub_groups()
        else:
            self._index_stage12()
        for name, ranges in self.ranges.items():
            self._check_coverage(name, ranges)
        self.aliases: dict[str, str] = self._aliases()
        self.module_extra: dict[str, dict[str, Any]] = self._module_extra()
        self.meta: dict[str, Any] = self._meta(first)

    # -- opening files -----------------------------------------------------------------------------------
    def _load(self, fname: str) -> Any:
        if fname not in self._cache:
            self._cache[fname] = load_deepspeed_file(confined(self.path, fname, self.path))
        return self._cache[fname]

    def _checked_dict(self, fname: str) -> dict[str, Any]:
        obj = self._load(fname)
        if not isinstance(obj, dict):
            raise CheckpointError(f"{self.path}/{fname} holds a {type(obj).__name__}, not DeepSpeed's dict")
        return obj

    def _optimizer_state(self, fname: str) -> dict[str, Any]:
        sd = self._checked_dict(fname).get("optimizer_state_dict")
        if not isinstance(sd, dict):
            raise CheckpointError(f"{self.path}/{fname} has no 'optimizer_state_dict' dict")
        return sd

    def release(self, files: list[str] | set[str]) -> None:
        """Drop the loaded ``files`` (they load again if read later)."""
        for fname in files:
            self._cache.pop(fname, None)

    def close(self) -> None:
        self._cache.clear()

    def __enter__(self) -> DeepSpeedReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- the index -----------------------------------------------------------------------------------------
    def _group_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        shapes = self.model_states.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise CheckpointError(f"{self.path}: the model states hold no 'param_shapes' list of dicts")
        out = []
        for gi, group in enumerate(shapes):
            out.append(
                [(str(n), _shape(s, f"{self.path}: param_shapes[{gi}][{n!r}]")) for n, s in group.items()]
            )
            for name, shape in out[-1]:
                self.params[name] = {"shape": list(shape), "group": gi}
                self.ranges[name] = []
        return out

    def _base_state(self, sd: dict[str, Any], fname: str, group: int) -> dict[str, Any]:
        """Torch optimizer state of flat group ``group`` of one rank (elastic or plain layout)."""
        base = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
        if isinstance(base, list):  # elastic_checkpoint: one lean state per group
            state = base[group] if group < len(base) else {}
        elif isinstance(base, dict) and isinstance(base.get("state"), dict):
            groups = base.get("param_groups", [])
            key = groups[group]["params"][0] if group < len(groups) else group
            state = base["state"].get(key, {})
        else:
            raise CheckpointError(f"{self.path}/{fname}: no torch optimizer state in the DeepSpeed optimizer")
        if "step" not in state and "base_optimizer_state_step" in sd:
            state = {**state, "step": torch.tensor(float(sd["base_optimizer_state_step"]))}
        return dict(state)

    def _record_group(self, sd: dict[str, Any], fname: str, group: int) -> dict[str, str]:
        """Remember one rank's scalars of ``group`` and the hyperparameters; return its state kinds."""
        state = self._base_state(sd, fname, group)
        kinds = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1:
                kinds[key] = VECTOR
            elif isinstance(value, torch.Tensor) and value.dim() == 0:
                kinds[key] = SCALAR
                self._step[(fname, group)] = value
        base = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
        groups = base.get("param_groups", []) if isinstance(base, dict) else []
        while len(self._param_groups) <= group:
            self._param_groups.append({})
        if group < len(groups):
            self._param_groups[group] = {k: v for k, v in groups[group].items() if k != "params"}
        return kinds

    def _index_stage12(self) -> None:
        shapes = self._group_shapes()
        flats: list[list[int]] = []  # [rank][group] -> partition length
        for fname in self.optim_files:
            sd = self._optimizer_state(fname)
            parts = sd.get("single_partition_of_fp32_groups")
            if not isinstance(parts, list) or len(parts) != len(shapes):
                raise CheckpointError(
                    f"{self.path}/{fname}: single_partition_of_fp32_groups is not a list of {len(shapes)} "
                    "tensors"
                )
            flats.append([int(t.numel()) for t in parts])
        paddings = self._optimizer_state(self.optim_files[0]).get("param_alignment_paddings")
        for gi, group in enumerate(shapes):
            pads = paddings[gi] if isinstance(paddings, list) and gi < len(paddings) else [0] * len(group)
            starts, at = [], 0
            for r in range(self.world_size):
                starts.append(at)
                at += flats[r][gi]
            kinds = [self._record_group(self._optimizer_state(f), f, gi) for f in self.optim_files]
            offset = 0
            for (name, shape), pad in zip(group, pads, strict=False):
                numel = math.prod(shape)
                for r, fname in enumerate(self.optim_files):
                    lo, hi = max(offset, starts[r]), min(offset + numel, starts[r] + flats[r][gi])
                    if lo < hi:
                        self.ranges[name].append(
                            DeepSpeedRange(fname, lo - offset, hi - offset, gi, gi, lo - starts[r], kinds[r])
                        )
                offset += numel + int(pad)
            self.release(set(self.optim_files[1:]))

    def _index_stage3(self) -> None:
        shapes = self._group_shapes()
        w = self.world_size
        for r, fname in enumerate(self.optim_files):
            sd = self._optimizer_state(fname)
            flat = sd.get("fp32_flat_groups")
            if not isinstance(flat, list) or len(flat) != len(shapes):
                raise CheckpointError(
                    f"{self.path}/{fname}: fp32_flat_groups is not a list of {len(shapes)} tensors (one per "
                    "sub-group of param_shapes)"
                )
            for gi, group in enumerate(shapes):
                kinds = self._record_group(sd, fname, gi)
                offset = 0
                for name, shape in group:
                    numel = math.prod(shape)
                    chunk = math.ceil(numel / w)
                    lo, hi = min(r * chunk, numel), min((r + 1) * chunk, numel)
                    if lo < hi:
                        self.ranges[name].append(DeepSpeedRange(fname, lo, hi, gi, gi, offset, kinds))
                    offset += chunk
                if offset > flat[gi].numel():
                    raise CheckpointError(
                        f"{self.path}/{fname}: fp32_flat_groups[{gi}] has {flat[gi].numel()} elements, the "
                        f"parameters of param_shapes[{gi}] need {offset}"
                    )
            if r:
                self.release([fname])

    def _merge_sub_groups(self) -> None:
        """Stage 3 splits a param group into sub-groups with the same hyperparameters: one group each."""
        merged: list[dict[str, Any]] = []
        index: list[int] = []
        for hyper in self._param_groups:
            if hyper not in merged:
                merged.append(hyper)
            index.append(merged.index(hyper))
        self._param_groups = merged
        for name, ranges in self.ranges.items():
            self.ranges[name] = [replace(r, group=index[r.flat]) for r in ranges]

    def _check_coverage(self, name: str, ranges: list[DeepSpeedRange]) -> None:
        ranges.sort(key=lambda r: r.start)
        at = 0
        for r in ranges:
            if r.start != at:
                break
            at = r.end
        if at != self.numel(name):
            raise CheckpointError(
                f"{self.path}: the rank files hold elements up to {at} of {name!r}, which has "
                f"{self.numel(name)}: the checkpoint is incomplete or its partitions are inconsistent"
            )

    def _aliases(self) -> dict[str, str]:
        shared = self.model_states.get("shared_params") or {}
        if not isinstance(shared, dict):
            raise CheckpointError(f"{self.path}: shared_params is a {type(shared).__name__}, not a dict")
        return {str(a): str(t) for a, t in shared.items() if str(t) in self.params}

    def _module_extra(self) -> dict[str, dict[str, Any]]:
        """The module entries no flat group holds: buffers and frozen parameters."""
        module = self.model_states.get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{self.path}: the model states hold no 'module' state dict")
        self._frozen: dict[str, tuple[int, ...]] = {}
        frozen = self.model_states.get("frozen_param_shapes") if self.stage == 3 else None
        if isinstance(frozen, dict):
            self._frozen = {
                str(n): _shape(s, f"{self.path}: frozen_param_shapes[{n!r}]") for n, s in frozen.items()
            }
        buffers = self.model_states.get("buffer_names") or []
        out: dict[str, dict[str, Any]] = {}
        for key, value in module.items():
            if key in self.params or key in self.aliases or not isinstance(value, torch.Tensor):
                continue
            entry: dict[str, Any] = {"key": key, "dtype": _dtype(value), "shape": tuple(value.shape)}
            if key in self._frozen:
                out[key] = {**entry, "shape": self._frozen[key], "parameter": True}
            elif key in buffers:
                out[key] = entry
            elif self.stage == 3 and value.numel() == 0:
                logger.warning("%s: %r is an empty stage-3 placeholder with no saved values", self.path, key)
            else:
                out[key] = {**entry, "parameter": True}  # a frozen parameter, saved whole in the module
        return out

    def _meta(self, first: dict[str, Any]) -> dict[str, Any]:
        ms = self.model_states
        scaler = first.get("loss_scaler")
        counters = {
            k: _int(ms.get(k, 0) or 0, f"{self.path}: {k}")
            for k in ("global_steps", "global_samples", "skipped_steps")
        }
        return {
            "format": "deepspeed",
            "world_size": self.world_size,
            "stage": self.stage,
            "counters": counters,
            "optimizer": {
                "param_groups": [
                    {"hyperparameters": g, "params": [n for n in self.params if self._group_of(n) == gi]}
                    for gi, g in enumerate(self._param_groups)
                ]
            },
            "lr_scheduler": None if ms.get("lr_scheduler") is None else {"state": ms["lr_scheduler"]},
            "loss_scaler": None if scaler is None else {"state": loss_scaler_state(scaler)},
            "client_state": {k: v for k, v in ms.items() if k not in _ENGINE_KEYS},
            "ds_config": ms.get("ds_config"),
            "state_dict_keys": [k for k in (ms.get("module") or {}) if isinstance(k, str)],
        }

    def _group_of(self, name: str) -> int | None:
        return self.ranges[name][0].group if self.ranges[name] else None

    # -- CheckpointReader's interface ---------------------------------------------------------------------
    def canonical(self, name: str) -> str | None:
        if name in self.params or name in self.module_extra:
            return name
        target = self.aliases.get(name)
        return target if target is not None and target in self.params else None

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.params:
            return tuple(self.params[name]["shape"])
        return tuple(self.module_extra[name]["shape"])

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def stored_dtype(self, name: str) -> torch.dtype:
        if name in self.params:
            return torch.float32
        return getattr(torch, self.module_extra[name]["dtype"])  # type: ignore[no-any-return]

    def files_for(self, name: str, start: int, end: int) -> list[str]:
        if name not in self.params:
            return []
        return [r.file for r in self.ranges[name] if r.start < end and start < r.end]

    def verify_files(self, files: set[str] | list[str]) -> None:
        """DeepSpeed records no checksums: opening each rank file (a well-formed, allowed pickle) is the
        check. Names that are not rank files of this checkpoint (zeroshard's own) are ignored."""
        for fname in sorted(set(files) & set(self.optim_files)):
            self._optimizer_state(fname)

    def _flat(self, r: DeepSpeedRange, state: str | None) -> torch.Tensor:
        sd = self._optimizer_state(r.file)
        group = r.flat
        if state is not None:
            value = self._base_state(sd, r.file, group).get(state)
        elif self.stage == 3:
            value = sd["fp32_flat_groups"][group]
        else:
            value = sd["single_partition_of_fp32_groups"][group]
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            raise CheckpointError(f"{self.path}/{r.file}: no flat {state or 'fp32'} tensor for group {group}")
        return value

    def read_range(
        self, name: str, start: int, end: int, out: torch.Tensor | None = None, state: str | None = None
    ) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened parameter (or of its optimizer state ``state``)."""
        if name not in self.params:
            if state is not None:
                raise CheckpointError(f"{self.path}: {name!r} was not trained, so it has no optimizer state")
            full = self._module_tensor(name).reshape(-1)[start:end]
            return full.clone() if out is None else out.copy_(full)
        result = out if out is not None else torch.empty(end - start, dtype=torch.float32)
        for r in self.ranges[name]:
            lo, hi = max(start, r.start), min(end, r.end)
            if lo >= hi:
                continue
            flat = self._flat(r, state)
            at = r.offset + lo - r.start
            if at + hi - lo > flat.numel():
                raise CheckpointError(
                    f"{self.path}/{r.file}: flat group {r.group} has {flat.numel()} elements, {name!r} needs "
                    f"{at + hi - lo}"
                )
            result[lo - start : hi - start].copy_(flat[at : at + hi - lo])
        return result

    def _module_tensor(self, name: str) -> torch.Tensor:
        if name in self._frozen:
            pieces = []
            for r in range(self.world_size):
                fname = f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
                fragments = self._checked_dict(fname).get("frozen_param_fragments") or {}
                if name not in fragments:
                    raise CheckpointError(f"{self.path}/{fname} has no frozen_param_fragments[{name!r}]")
                pieces.append(fragments[name].reshape(-1))
                if r:
                    self.release([fname])
            return torch.cat(pieces)[: self.numel(name)].reshape(self.shape(name))
        value = self.model_states["module"][name]
        if tuple(value.shape) != self.shape(name):
            raise CheckpointError(f"{self.path}: module[{name!r}] has shape {list(value.shape)}")
        return value  # type: ignore[no-any-return]

    def read_full(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = torch.empty(self.numel(name), dtype=dtype or self.stored_dtype(name))
        return self.read_range(name, 0, self.numel(name), out=out).reshape(self.shape(name))

    def range_states(self, name: str, start: int, end: int) -> dict[str, str]:
        found: dict[str, str] | None = None
        for r in self.ranges.get(name, []):
            if r.start < end and start < r.end:
                if found is None:
                    found = dict(r.states)
                elif found != r.states:
                    raise CheckpointError(
                        f"{self.path}: {name!r} has optimizer state {sorted(found)} in {r.file} and "
                        f"{sorted(r.states)} in another rank file: the checkpoint is inconsistent"
                    )
        return found or {}

    def read_state(self, name: str, start: int, end: int, state: str) -> Any:
        kind = self.range_states(name, start, end).get(state)
        if kind == VECTOR:
            return self.read_range(name, start, end, state=state)
        values = {
            float(self._step[(r.file, r.flat)]) for r in self.ranges[name] if r.start < end and start < r.end
        }
        if len(values) != 1:
            raise CheckpointError(f"{self.path}: {state!r} of {name!r} differs between rank files: {values}")
        first = next(r for r in self.ranges[name] if r.start < end and start < r.end)
        return self._step[(first.file, first.flat)].clone()

    def decode(self, obj: Any) -> Any:
        """DeepSpeed's values are already Python objects (kept for CheckpointReader's interface)."""
        return obj


def loss_scaler_state(scaler: Any) -> dict[str, Any]:
    """zeroshard's loss-scaler state (core/loss_scaler.py) from DeepSpeed's pickled scaler."""
    if not isinstance(scaler, DeepSpeedObject):
        raise CheckpointError(f"loss_scaler is a {type(scaler).__name__}, not a DeepSpeed loss scaler")
    state = {
        "scale": float(scaler.get("cur_scale", 1.0)),
        "dynamic": bool(scaler.get("dynamic", False)),
    }
    if state["dynamic"]:
        state.update(
            window=int(scaler.get("scale_window")),
            min_scale=float(scaler.get("min_scale")),
            hysteresis=int(scaler.get("delayed_shift")),
            consecutive_hysteresis=bool(scaler.get("consecutive_hysteresis")),
            factor=float(scaler.get("scale_factor")),
            cur_iter=int(scaler.get("cur_iter")),
            last_overflow_iter=int(scaler.get("last_overflow_iter")),
            cur_hysteresis=int(scaler.get("cur_hysteresis")),
        )
    return state


AnyReader: TypeAlias = CheckpointReader | DeepSpeedReader


def open_reader(path: str) -> AnyReader:
    """The reader for checkpoint directory ``path``: zeroshard's own format, or DeepSpeed's."""
    if not os.path.isfile(os.path.join(path, METADATA_FILE)) and is_deepspeed_checkpoint(path):
        return DeepSpeedReader(path)
    return CheckpointReader(path)
