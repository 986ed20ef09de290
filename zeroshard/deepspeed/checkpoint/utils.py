"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.deepspeed import surface

__all__ = ["clone_tensors_for_torch_save"]


_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _CPU) -> Any:
    """A copy of ``item`` (tensors inside lists, tuples and dicts) whose tensors are detached clones on
    ``device``, so that ``torch.save`` writes each tensor's own values, not the storage it is a view of."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
