"""``deepspeed.runtime.dataloader``: ``RepeatingLoader`` (also ``deepspeed.utils.RepeatingLoader``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from zeroshard.deepspeed import surface

__all__ = ["RepeatingLoader"]

T = TypeVar("T")


class RepeatingLoader(Generic[T]):
    """An endless iterator over ``loader``: when one pass ends, the next starts at once.

    Each pass is a fresh ``iter(loader)``, so a ``DataLoader`` reshuffles (or a sampler's ``set_epoch``
    takes effect) between passes exactly as it would in an epoch loop. ``loader.loader`` is the wrapped
    loader and ``data_iter`` the current pass, DeepSpeed's attribute names. A loader that yields nothing
    raises ``StopIteration`` from ``next`` instead of looping forever.
    """

    def __init__(self, loader: Iterable[T]) -> None:
        self.loader = loader
        self.data_iter: Iterator[T] = iter(loader)

    def __iter__(self) -> RepeatingLoader[T]:
        return self

    def __next__(self) -> T:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)  # the next pass; an empty loader stops here too
            return next(self.data_iter)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
