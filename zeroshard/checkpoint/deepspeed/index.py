"""Where each parameter's elements sit in a DeepSpeed checkpoint's files: the index DeepSpeedReader reads by.

See deepspeed/reader.py [Note: DeepSpeed checkpoint layout] for the layouts. The result, :class:`Index`,
lists for every trained parameter the ranges of its flattened elements each file holds, where in which
flat tensor, and with which optimizer states; its invariant (checked) is that the ranges tile every
parameter exactly.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.reader import SCALAR, VECTOR

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedRange:
    """Elements ``[start, end)`` of one parameter, held by file ``file`` in its flat tensor ``flat`` (the
    fp32 master and each optimizer state tensor alike) from element ``offset`` of that tensor; ``group``
    is the param group of the optimizer it belongs to. At stage 0 ``flat`` is the optimizer's index of the
    parameter, whose tensors are not flat."""

    file: str
    start: int
    end: int
    group: int | None
    flat: int
    offset: int
    states: dict[str, str] = field(default_factory=dict)


@dataclass
class Index:
    """``params``: name -> {"shape", "group"}, in flat order; ``ranges``: name -> its saved ranges;
    ``param_groups``: hyperparameters per param group; ``scalars``: (file, flat) -> ``step``."""

    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    ranges: dict[str, list[DeepSpeedRange]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    scalars: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


def as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{what} is {value!r}, not a non-negative integer")
    return int(value)


def as_shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list, torch.Size)):
        raise CheckpointError(f"{what} is a {type(value).__name__}, not a shape")
    return tuple(as_int(d, what) for d in value)


def base_state(sd: Mapping[str, Any], where: str, group: int) -> dict[str, Any]:
    """Torch optimizer state of flat group ``group`` in one rank's ZeRO optimizer state (elastic or not)."""
    base = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
    if isinstance(base, list):  # elastic_checkpoint: one lean state per group
        state = base[group] if group < len(base) else {}
    elif isinstance(base, dict) and isinstance(base.get("state"), dict):
        groups = base.get("param_groups", [])
        key = groups[group]["params"][0] if group < len(groups) else group
        state = base["state"].get(key, {})
    else:
        raise CheckpointError(f"{where}: no torch optimizer state in the DeepSpeed optimizer")
    if "step" not in state and "base_optimizer_state_step" in sd:
        state = {**state, "step": torch.tensor(float(sd["base_optimizer_state_step"]))}
    return dict(state)


class IndexBuilder:
    """Builds the :class:`Index` of one checkpoint from its files, loaded through ``load(file)`` (which
    returns the file's ``optimizer_state_dict``) and dropped again with ``release(files)``."""

    def __init__(
        self,
        path: str,
        model_states: Mapping[str, Any],
        optim_files: list[str],
        load: Callable[[str], dict[str, Any]],
        release: Callable[[list[str]], None],
    ) -> None:
        self.path = path
        self.model_states = model_states
        self.optim_files = optim_files
        self.load = load
        self.release = release
        self.index = Index()

    def build(self, stage: int, trainable: list[str] | None) -> Index:
        if stage == 0:
            self._stage0(trainable)
        elif stage == 3:
            self._stage3()
            self._merge_sub_groups()
        else:
            self._stage12()
        for name, ranges in self.index.ranges.items():
            self._check_coverage(name, ranges)
        return self.index

    def _group_shapes(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        shapes = self.model_states.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise CheckpointError(f"{self.path}: the model states hold no 'param_shapes' list of dicts")
        out = []
        for gi, group in enumerate(shapes):
            where = f"{self.path}: param_shapes[{gi}]"
            out.append([(str(n), as_shape(s, f"{where}[{n!r}]")) for n, s in group.items()])
            for name, shape in out[-1]:
                self.index.params[name] = {"shape": list(shape), "group": gi}
                self.index.ranges[name] = []
        return out

    def _kinds(
        self, state: Mapping[str, Any], file: str, flat: int, shape: tuple[int, ...]
    ) -> dict[str, str]:
        """The kind of each optimizer state; scalars (``step``) are remembered."""
        kinds = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                kinds[key] = SCALAR
                self.index.scalars[(file, flat)] = value
            elif isinstance(value, torch.Tensor) and tuple(value.shape) == shape:
                kinds[key] = VECTOR
        return kinds

    def _record_group(self, sd: Mapping[str, Any], file: str, group: int) -> dict[str, str]:
        """The kinds of one rank's optimizer states of flat group ``group`` (flat ones are 1-D, of the
        partition's length); its scalars and the group's hyperparameters are remembered."""
        kinds = {}
        for key, value in base_state(sd, f"{self.path}/{file}", group).items():
            if isinstance(value, torch.Tensor) and value.dim() == 0:
                kinds[key] = SCALAR
                self.index.scalars[(file, group)] = value
            elif isinstance(value, torch.Tensor) and value.dim() == 1:
                kinds[key] = VECTOR
        base = sd.get("base_optimizer_state", sd.get("optimizer_state_dict"))
        groups = base.get("param_groups", []) if isinstance(base, dict) else []
        while len(self.index.param_groups) <= group:
            self.index.param_groups.append({})
        if group < len(groups):
            self.index.param_groups[group] = {k: v for k, v in groups[group].items() if k != "params"}
        return kinds

    def _stage12(self) -> None:
        shapes = self._group_shapes()
        lengths: list[list[int]] = []  # [rank][group] -> partition length
        for fname in self.optim_files:
            parts = self.load(fname).get("single_partition_of_fp32_groups")
            if not isinstance(parts, list) or len(parts) != len(shapes):
                raise CheckpointError(
                    f"{self.path}/{fname}: single_partition_of_fp32_groups is not a list of {len(shapes)} "
                    "tensors"
                )
            lengths.append([int(t.numel()) for t in parts])
        paddings = self.load(self.optim_files[0]).get("param_alignment_paddings")
        for gi, group in enumerate(shapes):
            pads = paddings[gi] if isinstance(paddings, list) and gi < len(paddings) else [0] * len(group)
            starts = [sum(lengths[r][gi] for r in range(rank)) for rank in range(len(self.optim_files))]
            kinds = [self._record_group(self.load(f), f, gi) for f in self.optim_files]
            offset = 0
            for (name, shape), pad in zip(group, pads, strict=False):
                numel = math.prod(shape)
                for r, fname in enumerate(self.optim_files):
                    lo, hi = max(offset, starts[r]), min(offset + numel, starts[r] + lengths[r][gi])
                    if lo < hi:
                        self.index.ranges[name].append(
                            DeepSpeedRange(fname, lo - offset, hi - offset, gi, gi, lo - starts[r], kinds[r])
                        )
                offset += numel + int(pad)
            self.release(self.optim_files[1:])

    def _stage3(self) -> None:
        shapes = self._group_shapes()
        w = len(self.optim_files)
        for r, fname in enumerate(self.optim_files):
            sd = self.load(fname)
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
                        self.index.ranges[name].append(DeepSpeedRange(fname, lo, hi, gi, gi, offset, kinds))
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
        for hyper in self.index.param_groups:
            if hyper not in merged:
                merged.append(hyper)
            index.append(merged.index(hyper))
        self.index.param_groups = merged
        for name, ranges in self.index.ranges.items():
            self.index.ranges[name] = [replace(r, group=index[r.flat]) for r in ranges]

    def _stage0(self, trainable: list[str] | None) -> None:
        """Stage 0: the torch optimizer's state dict, keyed by position, in the model-states file."""
        opt = stage0_optimizer(self.model_states, self.path)
        inner = opt.get("optimizer_state_dict", opt)
        groups, state = inner.get("param_groups"), inner.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise CheckpointError(f"{self.path}: the stage-0 optimizer state has no param_groups and state")
        order = [(gi, int(idx)) for gi, g in enumerate(groups) for idx in g["params"]]
        names = self._stage0_names(order, state, opt, trainable)
        module = self.model_states["module"]
        for (gi, idx), name in zip(order, names, strict=True):
            shape = tuple(module[name].shape)
            self.index.params[name] = {"shape": list(shape), "group": gi}
            kinds = self._kinds(state.get(idx, {}), "model", idx, shape)
            self.index.ranges[name] = [DeepSpeedRange("model", 0, math.prod(shape), gi, idx, 0, kinds)]
        self.index.param_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def _stage0_names(
        self,
        order: list[tuple[int, int]],
        state: Mapping[int, Any],
        opt: Mapping[str, Any],
        trainable: list[str] | None,
    ) -> list[str]:
        """The parameter each optimizer position holds. DeepSpeed records no names at stage 0: they are the
        live model's trained parameters in order (as ``model.parameters()`` gave them to DeepSpeed), or,
        offline, the module's entries taken in order where their shapes fit."""
        module = self.model_states["module"]
        buffers = set(self.model_states.get("buffer_names") or [])
        masters = stage0_masters(opt)

        def shape_of(pos: int, gi: int, idx: int) -> tuple[int, ...] | None:
            if masters is not None:
                return tuple(masters[pos].shape)
            vectors = [v for v in state.get(idx, {}).values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            return tuple(vectors[0].shape) if vectors else None

        if trainable is not None:
            names = [n for n in trainable if n in module]
            if len(names) != len(order):
                raise CheckpointError(
                    f"{self.path}: the stage-0 optimizer holds {len(order)} parameters, the model trains "
                    f"{len(names)} of those the checkpoint names: they do not correspond"
                )
        else:
            candidates = [k for k in module if k not in buffers and k not in self.aliases_by_storage()]
            names, at = [], 0
            for pos, (gi, idx) in enumerate(order):
                want = shape_of(pos, gi, idx)
                while (
                    at < len(candidates) and want is not None and tuple(module[candidates[at]].shape) != want
                ):
                    at += 1
                if at >= len(candidates):
                    raise CheckpointError(
                        f"{self.path}: cannot tell which module entry the stage-0 optimizer's parameter "
                        f"{idx} is (DeepSpeed records no names at stage 0): load it into the model with "
                        "engine.load_checkpoint instead"
                    )
                names.append(candidates[at])
                at += 1
            if len(candidates) > len(order):
                logger.warning(
                    "%s: stage-0 checkpoint: trained parameters told from frozen ones by shape and order "
                    "(DeepSpeed records no names at stage 0)",
                    self.path,
                )
        for pos, ((gi, idx), name) in enumerate(zip(order, names, strict=True)):
            want = shape_of(pos, gi, idx)
            if want is not None and want != tuple(module[name].shape):
                raise CheckpointError(
                    f"{self.path}: the stage-0 optimizer's parameter {idx} has shape {list(want)}, the "
                    f"model's {name!r} {list(module[name].shape)}: they do not correspond"
                )
        return names

    def aliases_by_storage(self) -> dict[str, str]:
        """Tied module entries (pickled once, sharing storage): second name -> first name."""
        seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
        aliases: dict[str, str] = {}
        for key, value in (self.model_states.get("module") or {}).items():
            if not isinstance(value, torch.Tensor) or value.numel() == 0:
                continue
            ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()), tuple(value.shape))
            if ident in seen:
                aliases[key] = seen[ident]
            else:
                seen[ident] = key
        return aliases

    def _check_coverage(self, name: str, ranges: list[DeepSpeedRange]) -> None:
        ranges.sort(key=lambda r: r.start)
        at = 0
        for r in ranges:
            if r.start != at:
                break
            at = r.end
        numel = math.prod(self.index.params[name]["shape"])
        if at != numel:
            raise CheckpointError(
                f"{self.path}: the rank files hold elements up to {at} of {name!r}, which has {numel}: the "
                "checkpoint is incomplete or its partitions are inconsistent"
            )


def stage0_optimizer(model_states: Mapping[str, Any], path: str) -> dict[str, Any]:
    opt = model_states.get("optimizer")
    if not isinstance(opt, dict):
        raise CheckpointError(f"{path}: a stage-0 checkpoint with no optimizer state in its model states")
    return opt


def stage0_masters(opt: Mapping[str, Any]) -> list[torch.Tensor] | None:
    """The fp32 masters of a 16-bit stage-0 run, in optimizer order; None when the module's own (fp32)
    parameters are the masters."""
    groups = opt.get("fp32_groups")
    if not isinstance(groups, list):
        return None
    return [t for g in groups for t in g]
