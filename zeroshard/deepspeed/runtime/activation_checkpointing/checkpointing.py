"""``deepspeed.checkpointing``: DeepSpeed's activation-checkpointing API over ``torch.utils.checkpoint``.

DeepSpeed's module ``deepspeed.runtime.activation_checkpointing.checkpointing``, bound in ``deepspeed`` as
``checkpointing``.

``checkpoint`` is the reentrant kind (DeepSpeed's ``CheckpointFunction`` is), ``non_reentrant_checkpoint``
the other; both train exactly at every ZeRO stage ([Note: recompute] in
``zeroshard/core/stage3/gatherer.py``).
zeroshard is data parallel only, so the model-parallel parts are trivial: the RNG tracker has one state and
``partition_activations`` (which partitions across model-parallel ranks) has nothing to partition.
``checkpoint_in_cpu`` and ``contiguous_checkpointing`` are accepted and have no effect; ``configure`` logs
that once, naming them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from zeroshard.deepspeed import surface
from zeroshard.errors import ArgumentError

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
]

logger = logging.getLogger(__name__)

# DeepSpeed's API is module-level: `configure` once, then `checkpoint` anywhere.
_configured = False


def _with_kwargs(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Fold keyword arguments into positional ones (the reentrant kind takes positional tensors only)."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def call(*everything: Any) -> Any:
        return function(*everything[:count], **dict(zip(keys, everything[count:], strict=True)))

    return call, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward."""
    function, args = _with_kwargs(function, args, kwargs)
    return _torch_checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """The non-reentrant kind (saved-tensor hooks; inputs need not require grad)."""
    return _torch_checkpoint(function, *args, use_reentrant=False)


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Mark checkpointing configured; options that change nothing here are named in one log line.

    Raises:
        ArgumentError: ``contiguous_checkpointing`` without ``num_checkpoints`` (also DeepSpeed's
            ``AssertionError``).
    """
    global _configured
    if contiguous_checkpointing and num_checkpoints is None:
        raise ArgumentError(
            "deepspeed.checkpointing.configure(contiguous_checkpointing=True) needs num_checkpoints, the "
            "number of layers checkpointed, as in DeepSpeed"
        )
    _configured = True
    inert = {
        "contiguous_checkpointing": contiguous_checkpointing,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    named = [key for key, value in inert.items() if value]
    if named:
        logger.warning("deepspeed.checkpointing.configure: %s have no effect in zeroshard", ", ".join(named))


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """DeepSpeed frees its partitioned-activation buffers here; zeroshard keeps none."""


def set_num_layers(nlayers: int) -> None:
    """Used by DeepSpeed's contiguous checkpointing; nothing to size here."""


class _RNGTracker:
    """One RNG state: without model parallelism every "tracked" region uses the default generator."""

    def add(self, name: str, seed: int) -> None:
        torch.manual_seed(seed)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        pass

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        yield


_TRACKER = _RNGTracker()


def get_cuda_rng_tracker() -> _RNGTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generators (one model-parallel rank: the data-parallel seed is the seed)."""
    torch.manual_seed(seed)


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
