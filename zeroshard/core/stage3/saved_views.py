"""Stage 3: tensors autograd saves from gathered parameters are kept as references, not as memory.

[Note: saved views]
A Linear saves ``weight.t()`` for its backward: a view of the unit's gathered buffer. Were autograd to keep
that tensor, releasing the unit after its forward (``param.data = empty``) would free nothing, and every
layer's full parameters would stay alive from its forward to its backward, whatever the prefetch and reuse
knobs say. While :class:`SavedViews` is active (every forward of a stage-3 model) a saved tensor that is a
view of a gathered unit's current buffer is packed as (unit, size, stride, offset) and rebuilt in backward
from the re-gathered buffer, which the gatherer's backward hooks normally have ready; if not, unpacking
gathers it (backward unpacks in the same order on every rank, so that gather is collective-safe).

Inside a ``GatheredParameters`` block these hooks are lifted (:func:`suspended`). Any saved-tensor hook makes
autograd hand backward a new tensor object, and code that gathers parameters by hand saves the parameter
itself and expects it back: TRL's fused LM-head loss calls ``ctx.save_for_backward(lm_head.weight)`` and in
backward reads ``weight.ds_status`` and gathers it again. Without our hooks autograd keeps the parameter
object, whose ``data`` the gatherer swaps as for any other use, as DeepSpeed's stage 3 does everywhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from zeroshard.core.flat_param import FlatUnit


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: kept in a WeakSet per unit
class _SavedView:
    unit: FlatUnit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class SavedViews:
    """The saved-tensor hooks of [Note: saved views].

    ``gather(units)`` is the gatherer's (collective) gather; :meth:`note` must see every unit right after
    it is gathered, so that its buffer is recognised.
    """

    def __init__(self, gather: Callable[[Sequence[FlatUnit]], None], rank: int) -> None:
        self._gather = gather
        self._rank = rank
        # Storage address of each unit's last gathered buffer, both ways (an entry is stale once the unit is
        # released and its address possibly reused: _pack checks).
        self._unit_at: dict[int, FlatUnit] = {}
        self._address_of: dict[int, int] = {}
        self._active: list[contextlib.AbstractContextManager[None]] = []
        # The packed views of each unit that autograd still holds. Autograd drops a node's saved tensors
        # once the node has run (unless the graph is retained), so an empty set means no backward node
        # left will read the unit through a saved tensor.
        self._live: dict[int, weakref.WeakSet[_SavedView]] = {}

    def note(self, unit: FlatUnit) -> None:
        """Remember where ``unit``'s gathered buffer lives."""
        if not unit.gathered:
            return
        address = unit.full.untyped_storage().data_ptr()
        old = self._address_of.get(unit.index)
        if old is not None and self._unit_at.get(old) is unit:
            del self._unit_at[old]
        self._address_of[unit.index] = address
        self._unit_at[address] = unit

    def held(self, unit: FlatUnit) -> bool:
        """Whether autograd still holds a tensor saved from ``unit``'s gathered buffer (a backward node that
        has not run yet, or a retained graph)."""
        live = self._live.get(unit.index)
        return live is not None and len(live) > 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def enter(self) -> None:
        """Activate until :meth:`exit` (from a forward pre-hook to a forward hook)."""
        context = self.active()
        context.__enter__()
        self._active.append(context)

    def exit(self) -> None:
        if self._active:
            self._active.pop().__exit__(None, None, None)

    @staticmethod
    def _is_ours(pack: Any) -> bool:
        return getattr(pack, "__func__", None) is SavedViews._pack

    def _pack(self, tensor: torch.Tensor) -> Any:
        address = tensor.untyped_storage().data_ptr()
        unit = self._unit_at.get(address)
        # Only the unit's current buffer: a released buffer's address may have been reused since.
        if unit is not None and unit.gathered and unit.full.untyped_storage().data_ptr() == address:
            view = _SavedView(unit, tensor.size(), tensor.stride(), int(tensor.storage_offset()))
            self._live.setdefault(unit.index, weakref.WeakSet()).add(view)
            return view
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _SavedView):
            return cast(torch.Tensor, packed)  # _pack returned the tensor itself
        unit = packed.unit
        if not unit.gathered:
            self._gather([unit])
        if not unit.gathered:
            names = ", ".join(unit.names)
            raise RuntimeError(
                f"rank {self._rank}: backward needs unit {unit.index} ({names}) after its gradients were "
                "already reduced and its parameters released"
            )
        return unit.full.as_strided(packed.size, packed.stride, packed.offset)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Lift the saved-tensor hooks of [Note: saved views] that are on top of torch's hook stack for the block,
    and put them back after it. Hooks that someone else pushed later (activation checkpointing's) stay, and
    so do ours below them."""
    autograd = torch._C._autograd
    top = getattr(autograd, "_top_saved_tensors_default_hooks", None)
    lifted: list[tuple[Any, Any]] = []
    while top is not None:
        hooks = top(False)
        if hooks is None or not SavedViews._is_ours(hooks[0]):
            break
        autograd._pop_saved_tensors_default_hooks()
        lifted.append(hooks)
    try:
        yield
    finally:
        for pack, unpack in reversed(lifted):
            autograd._push_saved_tensors_default_hooks(pack, unpack)
