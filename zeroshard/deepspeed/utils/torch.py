"""``deepspeed.utils.torch``: DeepSpeed's small helpers around the installed PyTorch.

- :func:`required_torch_version`: whether the running torch lies in a version range (DeepSpeed's scripts
  and tests gate features on it);
- :func:`register_grad_hook`: a hook run after a parameter's gradient is accumulated;
- :func:`jit_script_compat`: ``torch.compile`` where it works, else ``torch.jit.script``, else the function;
- :func:`is_functorch_transforming`: whether the caller runs under ``torch.func`` (grad, vmap, ...).

This module's name shadows nothing: the package imports are absolute, so ``import torch`` is PyTorch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.torch_version import TorchVersion

from zeroshard.deepspeed import surface
from zeroshard.errors import ArgumentError

__all__ = ["is_functorch_transforming", "jit_script_compat", "register_grad_hook", "required_torch_version"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def required_torch_version(
    min_version: float | str | None = None, max_version: float | str | None = None
) -> bool:
    """True when the installed torch is at least ``min_version`` and at most ``max_version``.

    Versions compare as release numbers (``2.1`` is ``"2.1"``; a local tag such as ``+cpu`` sorts after its
    release, as in DeepSpeed). At least one bound is required.

    Raises:
        ValueError: Neither bound given (DeepSpeed asserts; the error is also an ``AssertionError``).
    """
    if not min_version and not max_version:
        raise ArgumentError("required_torch_version: give min_version or max_version (or both)")
    installed = TorchVersion(torch.__version__)
    if min_version and installed < str(min_version):
        return False
    return not (max_version and installed > str(max_version))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> Any:
    """Run ``hook(param)`` after each accumulation into ``param.grad``; returns the removable handle."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn: _F) -> _F:
    """``fn`` under ``torch.compile``; where that fails, ``torch.jit.script``'s; else ``fn`` itself."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return torch.compile(fn)  # type: ignore[return-value]
    except Exception:  # any compiler failure falls back, as in DeepSpeed
        log.debug("torch.compile failed for %s; trying torch.jit.script", name, exc_info=True)
    try:
        return torch.jit.script(fn)  # type: ignore[no-any-return]
    except Exception:
        log.debug("torch.jit.script failed for %s; using it uncompiled", name, exc_info=True)
        return fn


def is_functorch_transforming() -> bool:
    """True inside a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
