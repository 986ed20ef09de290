"""Sharded, atomic, verified checkpoints that load at any world size and stage; consolidated export.

See format.py [Note: checkpoint format] for what is on disk and docs/checkpoints.md for how to use it.
"""

from __future__ import annotations

from zeroshard.checkpoint.convert import (
    convert_checkpoint,
    convert_to_deepspeed,
    convert_to_zeroshard,
    get_fp32_state_dict,
    load_state_dict_from_checkpoint,
    open_checkpoint,
)
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.export import load_consolidated, save_16bit_model, save_pretrained
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "convert_checkpoint",
    "convert_to_deepspeed",
    "convert_to_zeroshard",
    "get_fp32_state_dict",
    "load_checkpoint",
    "load_consolidated",
    "load_state_dict_from_checkpoint",
    "open_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "save_pretrained",
]
