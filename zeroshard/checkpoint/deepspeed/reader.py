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
deepspeed/pickles.py [Note: DeepSpeed pickles] allows, memory-mapped, one at a time where a caller
releases them.
"""

from __future__ import annotations

import logging
import math
import os
import re
from types import TracebackType
from typing import Any, TypeAlias

import torch

from zeroshard.checkpoint.deepspeed.index import (
    DeepSpeedRange,
    IndexBuilder,
    as_int,
    as_shape,
    base_state,
    stage0_masters,
    stage0_optimizer,
)
from zeroshard.checkpoint.deepspeed.pickles import DeepSpeedObject, load_deepspeed_file
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import METADATA_FILE, confined
from zeroshard.checkpoint.reader import VECTOR, CheckpointReader, agreed_states

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


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class DeepSpeedReader:
    """One DeepSpeed checkpoint (stages 0-3), with :class:`CheckpointReader`'s reading interface.

    Invariant (checked on open): for every trained parameter the ranges the rank files hold tile
    ``[0, numel)`` exactly, and every flat tensor is long enough for the ranges read from it.
    """

    def __init__(self, path: str, trainable: list[str] | None = None) -> None:
        """``trainable``: the live model's trained parameter names in ``model.parameters()`` order; only
        stage-0 checkpoints need them (they record no names), else their entries are matched by shape."""
        self.path = path
        self._cache: dict[str, Any] = {}
        names = os.listdir(path)
        optim = {int(m.group(2)): n for n in names if (m := _OPTIM_RE.match(n))}
        if sorted(optim) != list(range(len(optim))):
            raise CheckpointError(f"{path}: the optimizer files are for ranks {sorted(optim)}, not 0..W-1")
        self.optim_files = [optim[r] for r in range(len(optim))]
        model_name = MODEL_FILE if MODEL_FILE in names else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        self.model_states: dict[str, Any] = self._checked_dict(model_name)
        if self.optim_files:
            self.world_size = len(self.optim_files)
            first = self._optimizer_state(self.optim_files[0])
            # DeepSpeed's BF16_Optimizer (bf16 without ZeRO on an accelerator) writes ZeRO-1's layout and
            # no zero_stage.
            layout = 1 if "single_partition_of_fp32_groups" in first else 0
            self.stage = int(first.get("zero_stage", layout))
            if self.stage not in (1, 2, 3):
                raise CheckpointError(f"{path}/{self.optim_files[0]}: zero_stage {self.stage!r} is not 1-3")
            scaler = first.get("loss_scaler")
            scaler_state = None if scaler is None else loss_scaler_state(scaler)
        else:
            self.world_size = as_int(self.model_states.get("dp_world_size", 1), f"{path}: dp_world_size")
            self.stage = 0
            scaler_state = _stage0_scaler(stage0_optimizer(self.model_states, path))
        builder = IndexBuilder(path, self.model_states, self.optim_files, self._optimizer_state, self.release)
        index = builder.build(self.stage, trainable)
        self.params: dict[str, dict[str, Any]] = index.params
        self.ranges: dict[str, list[DeepSpeedRange]] = index.ranges
        self._param_groups = index.param_groups
        self._step = index.scalars
        shared = self.model_states.get("shared_params") if self.stage else builder.aliases_by_storage()
        if not isinstance(shared, dict | None):
            raise CheckpointError(f"{path}: shared_params is a {type(shared).__name__}, not a dict")
        self.aliases: dict[str, str] = {
            str(a): str(t) for a, t in (shared or {}).items() if str(t) in self.params
        }
        self.module_extra: dict[str, dict[str, Any]] = self._module_extra()
        self.meta: dict[str, Any] = self._meta(scaler_state)

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

    # -- what the model states add ------------------------------------------------------------------
    def _module_extra(self) -> dict[str, dict[str, Any]]:
        """The module entries no flat group holds: buffers and frozen parameters."""
        module = self.model_states.get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{self.path}: the model states hold no 'module' state dict")
        self._frozen: dict[str, tuple[int, ...]] = {}
        frozen = self.model_states.get("frozen_param_shapes") if self.stage == 3 else None
        if isinstance(frozen, dict):
            self._frozen = {
                str(n): as_shape(s, f"{self.path}: frozen_param_shapes[{n!r}]") for n, s in frozen.items()
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

    def _meta(self, scaler: dict[str, Any] | None) -> dict[str, Any]:
        ms = self.model_states
        counters = {
            k: as_int(ms.get(k, 0) or 0, f"{self.path}: {k}")
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
            "loss_scaler": None if scaler is None else {"state": scaler},
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

    def _flat(self, name: str, r: DeepSpeedRange, state: str | None) -> torch.Tensor:
        """The 1-D tensor holding ``r``: a rank's flat group, or at stage 0 the parameter's own tensor."""
        if self.stage == 0:
            opt = stage0_optimizer(self.model_states, self.path)
            inner = opt.get("optimizer_state_dict", opt)
            masters = stage0_masters(opt)
            if state is not None:
                value = inner["state"].get(r.flat, {}).get(state)
            elif masters is not None:
                value = masters[[i for g in inner["param_groups"] for i in g["params"]].index(r.flat)]
            else:
                value = self.model_states["module"][name]
            return value.reshape(-1) if isinstance(value, torch.Tensor) else _missing(self.path, name, state)
        sd = self._optimizer_state(r.file)
        if state is not None:
            value = base_state(sd, f"{self.path}/{r.file}", r.flat).get(state)
        elif self.stage == 3:
            value = sd["fp32_flat_groups"][r.flat]
        else:
            value = sd["single_partition_of_fp32_groups"][r.flat]
        if not isinstance(value, torch.Tensor) or value.dim() != 1:
            _missing(f"{self.path}/{r.file}", name, state)
        return value  # type: ignore[no-any-return]

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
            flat = self._flat(name, r, state)
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
        return agreed_states(self.path, name, self.ranges.get(name, []), start, end)

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


def _missing(where: str, name: str, state: str | None) -> Any:
    raise CheckpointError(f"{where}: no {state or 'fp32 master'} tensor for {name!r}")


def _stage0_scaler(opt: dict[str, Any]) -> dict[str, Any] | None:
    """zeroshard's loss-scaler state from a 16-bit stage-0 optimizer's fields; None in fp32."""
    if "cur_scale" not in opt:
        return None
    state: dict[str, Any] = {"scale": float(opt["cur_scale"]), "dynamic": bool(opt.get("dynamic_loss_scale"))}
    fields = {"cur_iter": "cur_iter", "last_overflow_iter": "last_overflow_iter", "scale_factor": "factor"}
    fields["scale_window"] = "window"
    state.update({ours: opt[theirs] for theirs, ours in fields.items() if opt.get(theirs) is not None})
    return state


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


def open_reader(path: str, trainable: list[str] | None = None) -> AnyReader:
    """The reader for checkpoint directory ``path``: zeroshard's own format, or DeepSpeed's (``trainable``:
    see :class:`DeepSpeedReader`)."""
    if not os.path.isfile(os.path.join(path, METADATA_FILE)) and is_deepspeed_checkpoint(path):
        return DeepSpeedReader(path, trainable)
    return CheckpointReader(path)
