"""``deepspeed.utils.init_on_device``: ``OnDevice``, build a model's tensors on a device and dtype of choice.

[Note: what OnDevice redirects]
Exactly what DeepSpeed's ``OnDevice`` redirects, no more:

- ``torch.empty``, ``torch.zeros``, ``torch.ones`` and ``torch.full`` (what ``nn.Linear``, ``nn.Embedding``,
  ``nn.LayerNorm`` ... allocate their parameters with): a call that names no ``device`` (or ``None``) gets
  ``OnDevice``'s device, and a floating-point result is cast to ``OnDevice``'s dtype, even one asked for
  by an explicit ``dtype=``; integer and boolean results keep their dtype.
- the legacy constructor ``torch.Tensor(*sizes)`` (older models write ``nn.Parameter(torch.Tensor(n, m))``):
  an uninitialized tensor of that size on the device, in the dtype.

Every other factory (``torch.randn``, ``torch.arange``, ``torch.tensor``, ``Tensor.new_*``) is left alone, as
DeepSpeed leaves it; ``with torch.device(...)`` is torch's way to redirect those too. The four factories are
caught by a ``TorchFunctionMode`` (torch's mechanism for this, scoped to the calling thread); the legacy
constructor goes through no mode, so ``Tensor.__new__`` is swapped for the duration of the block, which is
process-wide, as in DeepSpeed (``torch._dynamo`` is imported first: it rejects a swapped ``__new__`` when
it loads, which makes DeepSpeed's ``OnDevice(device="meta")`` fail on ``nn.Embedding`` in a fresh process).
Nested blocks work: the innermost one's device and dtype win.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from zeroshard.deepspeed import surface

__all__ = ["OnDevice"]

_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full})


def _to_floating(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


class _FactoryMode(TorchFunctionMode):
    """Gives the four factories of [Note: what OnDevice redirects] a default device and a floating dtype."""

    def __init__(self, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device = device
        self.dtype = dtype

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _FACTORIES:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        return _to_floating(func(*args, **kwargs), self.dtype)


def _restore_new(own: Any) -> None:
    """Put back ``torch.Tensor``'s own ``__new__`` (an outer block's); where it had none, inherit again."""
    if own is not None:
        setattr(torch.Tensor, "__new__", own)  # noqa: B010
    else:
        delattr(torch.Tensor, "__new__")


def _is_size(args: tuple[Any, ...]) -> bool:
    if len(args) == 1 and isinstance(args[0], torch.Size):
        return True
    return all(isinstance(a, int) and not isinstance(a, bool) for a in args) and len(args) > 0


class OnDevice:
    """Inside ``with OnDevice(dtype, device)``, the tensors a module's constructor allocates land on
    ``device`` (``"meta"``: no memory at all) with floating dtype ``dtype``; see [Note: what OnDevice
    redirects] for exactly which. ``enabled=False`` makes the block do nothing.

    Invariant: after the block, torch is as before it (the mode is popped, ``Tensor.__new__`` restored),
    whether the block returned or raised.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "meta", enabled: bool = True) -> None:
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._undo: contextlib.ExitStack | None = None

    def _legacy_new(self, previous: Any) -> Callable[..., torch.Tensor]:
        def new(cls: type, *args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_size(args) and not kwargs:
                return torch.empty(*args, device=self.device, dtype=self.dtype)
            # Data, not a size (DeepSpeed's OnDevice fails here): the constructor's tensor, moved and cast.
            made: torch.Tensor = previous(cls, *args, **kwargs)
            return _to_floating(made.to(self.device), self.dtype)

        return new

    def __enter__(self) -> None:
        if not self.enabled:
            return
        # torch._dynamo, first imported by an initializer on a meta tensor (nn.Embedding's normal_), checks
        # Tensor.__new__'s signature as it loads and fails on a swapped one: load it before the swap.
        importlib.import_module("torch._dynamo")
        undo = contextlib.ExitStack()
        undo.enter_context(_FactoryMode(self.device, self.dtype))
        undo.callback(_restore_new, torch.Tensor.__dict__.get("__new__"))
        setattr(torch.Tensor, "__new__", self._legacy_new(torch.Tensor.__new__))  # noqa: B010
        self._undo = undo

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo.close()  # Tensor.__new__ back first, then the mode popped


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
