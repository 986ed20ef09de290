"""Offline use of a checkpoint, without a process group: state dicts, loading into a model, conversion.

Each parameter is assembled from the saved ranges on its own (see reader.py), so loading into a model and
converting to consolidated safetensors hold one parameter at a time; only :func:`get_fp32_state_dict`,
which returns the whole state dict, holds the whole model.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from zeroshard.checkpoint.common import module_names
from zeroshard.checkpoint.deepspeed.reader import AnyReader, open_reader
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, write_consolidated
from zeroshard.checkpoint.format import resolve
from zeroshard.checkpoint.tensorfile import TensorSpec

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def open_checkpoint(ckpt_dir: str | os.PathLike[str], tag: str | None = None) -> AnyReader:
    """A reader for ``ckpt_dir`` (a save directory with ``latest``, or a checkpoint directory itself).

    Raises:
        CheckpointError: no ``latest`` and no tag, or no such checkpoint.
    """
    root = os.fspath(ckpt_dir)
    path = resolve(root, tag)
    if path is None:
        raise CheckpointError(f"{root} has no 'latest' file and no metadata.json: pass the tag to read")
    return open_reader(path)


def _tensor_keys(reader: AnyReader) -> list[str]:
    """The saved state_dict keys that hold tensors, without aliases, in the module's order."""
    keys = reader.meta.get("state_dict_keys") or [*reader.params, *reader.module_extra]
    return [
        k
        for k in keys
        if k not in reader.aliases and (k in reader.params or "key" in reader.module_extra.get(k, {}))
    ]


def get_fp32_state_dict(ckpt_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint: trained parameters from the fp32 masters, the rest as saved.

    Tied names map to the same tensor object. No process group is needed; this holds the whole model.
    """
    with open_checkpoint(ckpt_dir, tag) as reader:
        out: dict[str, torch.Tensor] = {}
        for key in _tensor_keys(reader):
            out[key] = reader.read_full(key)
        for alias, target in reader.aliases.items():
            if target in out:
                out[alias] = out[target]
        return out


def load_state_dict_from_checkpoint(
    model: nn.Module, ckpt_dir: str | os.PathLike[str], tag: str | None = None, strict: bool = True
) -> nn.Module:
    """Fill ``model`` from a checkpoint, one tensor at a time, read straight into each tensor where it can.

    Raises:
        CheckpointError: missing or unexpected keys (when ``strict``) or a shape mismatch.
    """
    with open_checkpoint(ckpt_dir, tag) as reader:
        names = module_names(model, [])
        state = model.state_dict(keep_vars=True)
        targets = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k not in names.aliases}
        missing = [k for k in targets if reader.canonical(k) is None]
        saved = set(_tensor_keys(reader)) | set(reader.aliases)
        unexpected = sorted(saved - set(state))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"{reader.path} does not match the model: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        with torch.no_grad():
            for key, tensor in targets.items():
                stored = reader.canonical(key)
                if stored is None:
                    continue
                if reader.shape(stored) != tuple(tensor.shape):
                    raise CheckpointError(
                        f"{reader.path}: {key!r} was saved with shape "
                        f"{list(reader.shape(stored))}, the model has {list(tensor.shape)}"
                    )
                data = tensor.data
                if data.is_contiguous() and data.device.type == "cpu":
                    reader.read_range(stored, 0, data.numel(), out=data.view(-1))
                else:
                    data.copy_(reader.read_full(stored))
    return model


def convert_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str | torch.dtype | None = "fp32",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write a checkpoint's weights as a ``save_pretrained``-style directory (see export.py), one
    parameter in memory at a time; ``config.json`` too when the checkpoint came from a Hugging Face model.

    ``dtype`` ("fp32", "bf16", "fp16" or a torch dtype) applies to floating tensors; None keeps them as
    stored. Returns the weight files written.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    out = os.fspath(out_dir)
    with open_checkpoint(ckpt_dir, tag) as reader:
        keys = _tensor_keys(reader)
        specs = []
        for key in keys:
            stored = reader.stored_dtype(key)
            want = dtype if dtype is not None and stored.is_floating_point else stored
            specs.append(TensorSpec(key, want, reader.shape(key)))

        def tensors() -> Iterator[torch.Tensor]:
            for spec in specs:
                yield reader.read_full(spec.key, dtype=spec.dtype)

        names = write_consolidated(out, specs, tensors(), max_shard_size)
        hf_config = reader.meta.get("hf_config")
        if hf_config is not None:
            if dtype is not None:  # transformers 5 calls the key "dtype", earlier versions "torch_dtype"
                key = "dtype" if "dtype" in hf_config else "torch_dtype"
                hf_config = {**hf_config, key: str(dtype).removeprefix("torch.")}
            with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
                json.dump(hf_config, f, indent=2)
    logger.info("converted %s to %s (%d weight files)", reader.path, out, len(names))
    return names


def convert_to_deepspeed(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tag: str | None = None,
    world_size: int | None = None,
    stage: int | None = None,
) -> str:
    """Write a checkpoint (zeroshard's or DeepSpeed's) as a DeepSpeed ZeRO checkpoint in ``out_dir``, for
    ``world_size`` ranks at ``stage`` (default: those it was saved with), one rank at a time; see
    deepspeed/writer.py. Returns the checkpoint directory written (``out_dir/<tag>``).

    Raises:
        ValueError: no stage given for a stage-0 checkpoint, or ``world_size``/``stage`` out of range.
    """
    from zeroshard.checkpoint.deepspeed.writer import write_deepspeed_checkpoint

    with open_checkpoint(ckpt_dir, tag) as reader:
        saved_stage = int(reader.meta.get("stage", 0))
        if stage is None and saved_stage == 0:
            raise ValueError(
                f"{reader.path} was saved at stage 0; DeepSpeed ZeRO checkpoints are stage 1, 2 or 3: "
                "pass stage="
            )
        return write_deepspeed_checkpoint(
            reader,
            out_dir,
            world_size=world_size if world_size is not None else int(reader.meta["world_size"]),
            stage=stage if stage is not None else saved_stage,
        )


def convert_to_zeroshard(
    ckpt_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None
) -> str:
    """Rewrite a DeepSpeed checkpoint in zeroshard's format (checksummed, no pickles) in ``out_dir``, one
    DeepSpeed rank file in memory at a time; see deepspeed/to_zeroshard.py. Returns the checkpoint directory.

    Raises:
        CheckpointError: ``ckpt_dir`` is not a DeepSpeed checkpoint (a zeroshard one needs no conversion).
    """
    from zeroshard.checkpoint.deepspeed.reader import DeepSpeedReader
    from zeroshard.checkpoint.deepspeed.to_zeroshard import write_zeroshard_checkpoint

    with open_checkpoint(ckpt_dir, tag) as reader:
        if not isinstance(reader, DeepSpeedReader):
            raise CheckpointError(f"{reader.path} is already a zeroshard checkpoint: nothing to convert")
        return write_zeroshard_checkpoint(reader, out_dir)
