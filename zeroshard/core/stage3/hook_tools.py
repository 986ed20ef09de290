"""Stage 3: small helpers for the gatherer's module and tensor hooks (no state, nothing collective)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (a module's outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def hook_outputs(output: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Register ``hook`` on every tensor of a module's ``output`` that requires grad: it runs when that
    tensor's gradient arrives in backward, just before the module's own backward."""
    for tensor in iter_tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(hook)


def eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` run eagerly under ``torch.compile``: the compiler stops at the hook (one graph break each),
    runs it as Python (collectives, ``param.data`` swaps) and compiles the module's own code around it.
    Traced instead, the gathers would break the graph at every collective and every buffer check."""
    disabled: Callable[..., Any] = torch.compiler.disable(hook, recursive=True)
    return disabled
