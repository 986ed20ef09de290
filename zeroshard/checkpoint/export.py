"""Consolidated weights: ``save_16bit_model`` and a ``save_pretrained``-style directory, streamed.

[Note: streaming export]
The output is the module's state_dict, one tensor per distinct tensor (a tied weight is written once,
under its first name, as Hugging Face does), in standard safetensors files: one file, or several plus
``model.safetensors.index.json`` when ``max_shard_size`` is exceeded. Shapes and dtypes are known in
advance, so each file's header is written first and then one tensor at a time: a parameter is assembled
(where its full value is not resident, gathered from the master shards, one parameter per collective),
written by rank 0, and dropped before the next. No rank ever holds more than one parameter beyond its
own state. The same writer serves the offline conversion (convert.py), which assembles each parameter
from the checkpoint's shard files instead.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from zeroshard.checkpoint.common import collectively, module_names, param_shape, untrained_state
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import FORMAT
from zeroshard.checkpoint.tensorfile import TensorFile, TensorSpec, fsync_dir, write_tensors
from zeroshard.core.flat_param import FlatUnit

if TYPE_CHECKING:
    from zeroshard.checkpoint.state import TrainingState
    from zeroshard.core.comm import Comm

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5e9 bytes (``"5GiB"``: 5 * 2**30), as Hugging Face's ``max_shard_size``."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        if match is None or match.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '5GB', '500MB', '2GiB'")
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return value


def split_files(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors into files of at most ``max_bytes`` (a larger tensor gets a file of its own)."""
    files: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not files or (size + spec.nbytes > max_bytes and files[-1]):
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files or [[]]


def write_consolidated(
    out_dir: str,
    specs: Sequence[TensorSpec],
    tensors: Iterator[torch.Tensor],
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    *,
    writer: bool = True,
    single_name: str = WEIGHTS_NAME,
) -> list[str]:
    """Write ``specs`` (values from ``tensors``, in order) as ``single_name`` or, beyond ``max_shard_size``
    (None: no limit), as numbered files plus ``model.safetensors.index.json``. Each file appears
    atomically (written under a temporary name).

    ``writer=False`` consumes ``tensors`` without writing (the ranks that take part in the gathers only).

    Returns:
        The file names written.
    """
    groups = split_files(specs, parse_size(max_shard_size)) if max_shard_size is not None else [list(specs)]
    names = (
        [single_name]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    if writer:
        os.makedirs(out_dir, exist_ok=True)
    for name, group in zip(names, groups, strict=True):
        if not writer:
            for _ in group:
                next(tensors)
            continue
        tmp = os.path.join(out_dir, f".{name}.tmp")
        write_tensors(tmp, group, tensors, {"format": "pt", "producer": FORMAT})
        os.replace(tmp, os.path.join(out_dir, name))
    if writer and len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.key: name for name, group in zip(names, groups, strict=True) for s in group},
        }
        tmp = os.path.join(out_dir, f".{INDEX_NAME}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, INDEX_NAME))
    if writer:
        fsync_dir(out_dir)
    return names


# -- from a live engine ----------------------------------------------------------------------------------


def _gather_from_masters(engine: TrainingState, unit: FlatUnit, index: int) -> torch.Tensor:
    """Parameter ``index`` of ``unit`` from the master shards, in the master dtype (1-D).

    Collective when the unit is sharded: each rank contributes its piece, padded to the largest piece.
    """
    # Over the group the unit is sharded over (hybrid sharding: the shard group, core/hybrid.py).
    return gather_param_from_shards(engine.sharded_step.comm, unit, index, unit.master, "export")


def gather_param_from_shards(
    comm: Comm, unit: FlatUnit, index: int, shard: torch.Tensor, purpose: str
) -> torch.Tensor:
    """Parameter ``index`` of ``unit`` assembled from every rank's ``shard`` (this rank's shard of a flat
    unit-sized tensor: the master, or the gradient shard), in its dtype (1-D).

    Collective when the unit is sharded: each rank contributes its piece, padded to the largest piece.
    """
    layout = unit.layout
    offset, numel = layout.offsets[index], layout.numels[index]
    if layout.world_size == 1:
        return shard[offset : offset + numel]
    size = layout.shard_size
    spans = {
        r: (max(offset, r * size), min(offset + numel, (r + 1) * size)) for r in layout.owner_ranks(index)
    }
    chunk = max((hi - lo for lo, hi in spans.values()), default=0)
    # On the group's device: a shard in CPU memory beside a GPU (offload) is gathered over NCCL there.
    mine = torch.zeros(chunk, dtype=shard.dtype, device=comm.device)
    if unit.rank in spans:
        lo, hi = spans[unit.rank]
        mine[: hi - lo].copy_(shard[lo - unit.rank * size : hi - unit.rank * size])
    gathered = torch.empty(layout.world_size * chunk, dtype=mine.dtype, device=mine.device)
    comm.all_gather(gathered, mine, what=f"{purpose} gather of {unit.names[index]}").wait()
    full = torch.empty(numel, dtype=mine.dtype, device=mine.device)
    for r, (lo, hi) in spans.items():
        full[lo - offset : hi - offset] = gathered[r * chunk : r * chunk + hi - lo]
    return full


def live_state(
    engine: TrainingState, dtype: torch.dtype | None = None, exclude_frozen_parameters: bool = False
) -> tuple[list[TensorSpec], Iterator[torch.Tensor]]:
    """The module's state_dict as specs and a generator of CPU tensors (see [Note: streaming export]).

    ``dtype`` casts floating tensors; None keeps each parameter's own (compute) dtype. Every rank must
    consume the generator to its end, in step. Collective: iterating it gathers sharded parameters.
    """
    names = module_names(engine.module, engine.units)
    where = {n: (u, i) for u in engine.units for i, n in enumerate(u.names)}
    untrained = untrained_state(engine.module, names)
    entries: list[tuple[str, Callable[[], torch.Tensor]]] = []
    specs: list[TensorSpec] = []
    resident = not engine.plan.shard_parameters
    for key in names.state_keys:
        if key in names.aliases:
            continue
        if key in where:
            unit, i = where[key]
            param = unit.params[i]
            want = dtype if dtype is not None else param.dtype
            # The full parameter is current and resident at stages 0-2: use it when it is asked for in its
            # own dtype or is the master itself (fp32 training); else gather the fp32 masters (exact, and
            # the only copy at stage 3).
            if resident and param.dtype in (want, unit.master.dtype):
                entries.append((key, functools.partial(torch.Tensor.detach, param)))
            else:
                entries.append((key, functools.partial(_gather_from_masters, engine, unit, i)))
            shape = param_shape(unit, i)
        else:
            value = untrained.get(key)
            if not isinstance(value, torch.Tensor):
                continue  # non-tensor extra state has no place in a weights file
            if exclude_frozen_parameters and isinstance(value, torch.nn.Parameter):
                continue
            want = dtype if dtype is not None and value.is_floating_point() else value.dtype
            entries.append((key, functools.partial(torch.Tensor.detach, value)))
            shape = tuple(value.shape)
        specs.append(TensorSpec(key, want, shape))

    def tensors() -> Iterator[torch.Tensor]:
        for (_, produce), spec in zip(entries, specs, strict=True):
            yield produce().to(device="cpu", dtype=spec.dtype).reshape(spec.shape)

    return specs, tensors()


def save_16bit_model(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    save_filename: str = WEIGHTS_NAME,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write the module's weights in their compute dtype to ``save_dir/save_filename`` (safetensors).

    At every stage, stage 3 included, the file holds the full consolidated weights, streamed as
    :func:`save_pretrained` streams them (see [Note: streaming export]): at stage 3 each parameter is
    gathered from the master shards in turn. ``zero_optimization.stage3_gather_16bit_weights_on_model_save``
    is accepted and has no effect: DeepSpeed needs it to write anything but empty placeholders at
    stage 3, zeroshard always writes the weights.

    Collective: call on all ranks.

    Returns:
        True (DeepSpeed's return value: the weights were written).
    """
    if not save_filename.endswith(".safetensors"):
        raise ValueError(
            f"save_filename={save_filename!r}: zeroshard writes safetensors (never pickles, so not "
            "DeepSpeed's pytorch_model.bin); use a name ending in .safetensors, e.g. model.safetensors"
        )
    specs, tensors = live_state(engine, None, exclude_frozen_parameters)
    out = os.fspath(save_dir)
    rank0 = engine.comm.rank == 0
    collectively(
        engine.comm,
        f"save_16bit_model to {out}",
        lambda: write_consolidated(out, specs, tensors, None, writer=rank0, single_name=save_filename),
    )
    return True


def save_pretrained(
    engine: TrainingState,
    save_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """A ``save_pretrained``-style directory: safetensors weights (sharded with an index when larger than
    ``max_shard_size``), and ``config.json`` (and ``generation_config.json``) when the module is a Hugging
    Face model, so that ``AutoModel*.from_pretrained(save_dir)`` loads it.

    Collective: call on all ranks. Returns the weight files written.
    """
    out = os.fspath(save_dir)
    specs, tensors = live_state(engine, dtype)
    rank0 = engine.comm.rank == 0

    def write() -> list[str]:
        names = write_consolidated(out, specs, tensors, max_shard_size, writer=rank0)
        if rank0:
            _save_hf_configs(engine.module, out, dtype)
        return names

    return collectively(engine.comm, f"export to {out}", write)


def _save_hf_configs(module: torch.nn.Module, out: str, dtype: torch.dtype | None) -> None:
    config = getattr(module, "config", None)
    if config is not None and callable(getattr(config, "save_pretrained", None)):
        config.save_pretrained(out)
        if dtype is not None:  # the dtype the weights were written in, not the one the model trains in
            path = os.path.join(out, "config.json")
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            key = "dtype" if "dtype" in saved else "torch_dtype"  # transformers 5 calls it "dtype"
            saved[key] = str(dtype).removeprefix("torch.")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(saved, f, indent=2)
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(out)


def load_consolidated(
    model: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True
) -> torch.nn.Module:
    """Load an export (a ``.safetensors`` file, or a directory with one or an index) into ``model``, one
    tensor at a time; tied weights are filled through their first name.

    Raises:
        CheckpointError: missing or unexpected keys (when ``strict``), or a shape mismatch.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        else:
            with TensorFile(os.path.join(path, WEIGHTS_NAME)) as tf:
                files = dict.fromkeys(tf.keys(), os.path.join(path, WEIGHTS_NAME))
    else:
        with TensorFile(path) as tf:
            files = dict.fromkeys(tf.keys(), path)
    names = module_names(model, [])
    state = model.state_dict(keep_vars=True)
    targets = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k not in names.aliases}
    missing = [k for k in targets if k not in files]
    unexpected = [k for k in files if k not in targets]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path} does not match the model: missing keys {missing}, unexpected keys {unexpected}"
        )
    open_files: dict[str, TensorFile] = {}
    try:
        with torch.no_grad():
            for key, tensor in targets.items():
                if key not in files:
                    continue
                tf = open_files.get(files[key]) or open_files.setdefault(files[key], TensorFile(files[key]))
                if tf.shape(key) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"{files[key]}: {key!r} has shape {list(tf.shape(key))}, the model "
                        f"{list(tensor.shape)}"
                    )
                tensor.data.copy_(tf.read_tensor(key))
    finally:
        for tf in open_files.values():
            tf.close()
    return model
