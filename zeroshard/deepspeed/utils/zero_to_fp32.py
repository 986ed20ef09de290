"""``deepspeed.utils.zero_to_fp32``: a ZeRO checkpoint's consolidated fp32 weights, offline.

DeepSpeed's module of this name (also copied into each of its checkpoints as ``zero_to_fp32.py``) rebuilds the
fp32 master weights from the per-rank files without a process group. Here the same functions read through
zeroshard's offline reader (:mod:`zeroshard.checkpoint.convert`), which opens zeroshard's checkpoints and
DeepSpeed's ZeRO layout alike (stages 0 to 3, written at any world size; checkpoint/deepspeed/reader.py).

The state dict holds the module's parameters (trained ones from the fp32 masters, frozen ones as saved)
and its buffers, under the module's names; tied names map to one tensor. Differences from DeepSpeed:

- ``lazy_mode=True`` returns the same tensors as ``lazy_mode=False`` (a tensor has the ``contiguous()``
  DeepSpeed's lazy tensors offer): the whole model is read at once. Converting to files
  (``convert_zero_checkpoint_to_state_dict``) reads one tensor at a time either way.
- ``safe_serialization=True`` writes safetensors files with zeroshard's own writer (no ``safetensors``
  package), ``max_shard_size`` splits without ``huggingface_hub``; file names and the index file are the
  ones DeepSpeed writes (``model.safetensors`` or ``model-00001-of-0000N.safetensors`` and
  ``model.safetensors.index.json``; ``pytorch_model*.bin`` and ``pytorch_model.bin.index.json`` without
  ``safe_serialization``).

Run as a script (``python -m zeroshard.deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR``) it takes
DeepSpeed's command-line arguments.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import re
from collections.abc import Iterator

import torch
from torch import nn

from zeroshard.checkpoint.convert import DTYPES
from zeroshard.checkpoint.deepspeed.reader import AnyReader, open_reader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, parse_size, split_files, write_consolidated
from zeroshard.checkpoint.format import resolve
from zeroshard.checkpoint.tensorfile import TensorSpec
from zeroshard.deepspeed import surface

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_checkpoint_files",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]

logger = logging.getLogger(__name__)

PICKLE_NAME = "pytorch_model.bin"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"


# -- the files of a DeepSpeed-format tag directory (Lightning reads its client state through these) --------


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The path of rank 0's model-states file in DeepSpeed tag directory ``checkpoint_dir`` (stages 0-2:
    ``mp_rank_00_model_states.pt``, stage 3: ``zero_pp_rank_0_mp_rank_00_model_states.pt``);
    ``FileNotFoundError`` when the directory or the file does not exist (a zeroshard-format checkpoint has
    no such file: save with ``format="deepspeed"`` for tools that read it)."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"get_model_state_file(zero_stage={zero_stage!r}): a ZeRO stage is 0, 1, 2 or 3")
    name = "mp_rank_00_model_states.pt" if zero_stage <= 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def _natural_key(text: str) -> list[int | str]:
    """Sort key that orders embedded numbers by value (``rank_2`` before ``rank_10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order; ``FileNotFoundError``
    when there is none."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every rank's optimizer-states file of a DeepSpeed tag directory, rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every model-states file of a DeepSpeed tag directory, rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _open(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> AnyReader:
    """The reader of ``checkpoint_dir/tag`` (default: the tag ``latest`` names), with DeepSpeed's errors for a
    missing ``latest`` (``ValueError``) and a missing tag directory (``FileNotFoundError``)."""
    root = os.fspath(checkpoint_dir)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"checkpoint directory {root!r} does not exist")
    try:
        path = resolve(root, tag)
    except CheckpointError as err:
        if tag is not None and not os.path.isdir(os.path.join(root, tag)):
            raise FileNotFoundError(f"{root!r} has no checkpoint {tag!r}: {err}") from err
        raise
    if path is None:
        raise ValueError(
            f"{root!r} has no 'latest' file naming its newest checkpoint: pass tag= (a directory name in it)"
        )
    return open_reader(path)


def _state_keys(reader: AnyReader, exclude_frozen_parameters: bool) -> list[str]:
    """The keys that hold tensors, each once (no aliases), in the module's order."""
    keys = reader.meta.get("state_dict_keys") or [*reader.params, *reader.module_extra]
    out = []
    for key in keys:
        if key in reader.aliases:
            continue
        if key in reader.params:
            out.append(key)
            continue
        entry = reader.module_extra.get(key, {})
        if "key" in entry and not (exclude_frozen_parameters and entry.get("parameter")):
            out.append(key)
    return out


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype={dtype}: expected torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    names = {**DTYPES, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if not isinstance(dtype, str):
        raise TypeError(f"dtype={dtype!r}: expected a torch dtype or one of {', '.join(names)}")
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: expected a torch dtype or one of {', '.join(names)}")
    return names[dtype]


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's state dict from ``checkpoint_dir/tag``, trained parameters in fp32, on the CPU.

    Args:
        checkpoint_dir: The save directory (holding ``latest`` and the tag directories), or a checkpoint
            directory itself.
        tag: The checkpoint to read; default: the one ``latest`` names.
        exclude_frozen_parameters: Leave out parameters that were not trained.
        lazy_mode: Accepted; the tensors are read at once either way (see the module docstring).

    Raises:
        ValueError: ``tag`` is None and ``checkpoint_dir`` has no ``latest`` file.
        FileNotFoundError: ``checkpoint_dir`` or its ``tag`` directory does not exist.
        CheckpointError: the checkpoint is incomplete or inconsistent (the message names the file).
    """
    with _open(checkpoint_dir, tag) as reader:
        keys = _state_keys(reader, exclude_frozen_parameters)
        out = {key: reader.read_full(key) for key in keys}
        for alias, target in reader.aliases.items():
            if target in out:
                out[alias] = out[target]
        return out


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """Write the checkpoint's state dict to ``output_dir`` as files ``torch.load`` (or safetensors) reads.

    Floating tensors are written in ``dtype`` (float32, bfloat16 or float16, as a torch dtype or a name);
    others keep theirs. One tensor is in memory at a time; a tied weight is written once, under its first
    name. Files beyond ``max_shard_size`` (None: one file) are split, with an index file mapping each name
    to its file.

    Returns:
        The names of the weight files written.

    Raises:
        As :func:`get_fp32_state_dict_from_zero_checkpoint`; ``ValueError`` / ``TypeError`` for ``dtype``
        or ``max_shard_size``.
    """
    want = _dtype(dtype)
    out = os.fspath(output_dir)
    with _open(checkpoint_dir, tag) as reader:
        specs = []
        for key in _state_keys(reader, exclude_frozen_parameters):
            stored = reader.stored_dtype(key)
            specs.append(TensorSpec(key, want if stored.is_floating_point else stored, reader.shape(key)))

        def tensors() -> Iterator[torch.Tensor]:
            for spec in specs:
                yield reader.read_full(spec.key, dtype=spec.dtype)

        if safe_serialization:
            names = write_consolidated(out, specs, tensors(), max_shard_size)
        else:
            names = _write_pickles(out, specs, tensors(), max_shard_size)
    logger.info("wrote %s's weights to %s (%d files)", reader.path, out, len(names))
    return names


def _write_pickles(
    out: str, specs: list[TensorSpec], tensors: Iterator[torch.Tensor], max_shard_size: int | str | None
) -> list[str]:
    """``torch.save`` files of ``specs`` (named as Hugging Face names them), one file's tensors in memory."""
    groups = split_files(specs, parse_size(max_shard_size)) if max_shard_size is not None else [specs]
    names = (
        [PICKLE_NAME]
        if len(groups) == 1
        else [f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin" for i in range(len(groups))]
    )
    os.makedirs(out, exist_ok=True)
    for name, group in zip(names, groups, strict=True):
        torch.save({spec.key: next(tensors) for spec in group}, os.path.join(out, name))
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.key: name for name, group in zip(names, groups, strict=True) for s in group},
        }
        with open(os.path.join(out, PICKLE_INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return names


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[str]:
    """:func:`convert_zero_checkpoint_to_state_dict` in float32."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (``strict=False``, as
    DeepSpeed loads them). Returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: list[str] | None = None) -> None:
    """DeepSpeed's ``zero_to_fp32.py`` command line: ``CHECKPOINT_DIR OUTPUT_DIR [options]``."""
    parser = argparse.ArgumentParser(description="Write a ZeRO checkpoint's consolidated fp32 weights.")
    parser.add_argument("checkpoint_dir", help="the save directory (with 'latest'), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the directory the weight files are written to")
    parser.add_argument("--max_shard_size", default=DEFAULT_MAX_SHARD_SIZE, help="largest file, e.g. 5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors, not pickles")
    parser.add_argument("-t", "--tag", default=None, help="the checkpoint to read (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="skip frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="log at DEBUG level")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here (constants, helpers)

if __name__ == "__main__":
    main()
