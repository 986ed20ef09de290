"""``deepspeed.runtime.utils``: DeepSpeed's helper functions that training scripts call, on one data-parallel
group with no model parallelism.

[Note: mpu means model parallelism]
Several of DeepSpeed's helpers take ``mpu``, a Megatron-style model-parallel unit. zeroshard has no model
parallelism: ``mpu=None`` (the default) is the only value they take, and anything else is refused with
``NotImplementedError`` naming it. With ``mpu=None`` their arithmetic is DeepSpeed's, including its float32
round trips, so the numbers are DeepSpeed's to the bit.

The memory helpers read the accelerator (``deepspeed.accelerator.get_accelerator()``): on the CPU that is the
process's resident memory, on CUDA torch's allocator.
"""

from __future__ import annotations

import gc
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import torch

from zeroshard.deepspeed import comm, surface
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.runtime._norms import (
    clip_grad_norm_,
    get_global_norm,
    get_grad_zeros,
    get_weight_norm,
    has_inf_or_nan,
    is_invalid_grad_norm,
)
from zeroshard.deepspeed.utils.logging import logger

__all__ = [
    "align_dense_tensors",
    "call_to_str",
    "clip_grad_norm_",
    "copy_to_device",
    "empty_cache",
    "ensure_directory_exists",
    "filter_empty_parameters",
    "get_global_norm",
    "get_grad_zeros",
    "get_ma_status",
    "get_only_unique_item",
    "get_tensor_bytes",
    "get_weight_norm",
    "has_inf_or_nan",
    "is_invalid_grad_norm",
    "is_model_parallel_parameter",
    "memory_status",
    "move_to_device",
    "noop_context",
    "noop_decorator",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "see_memory_usage",
    "set_random_seed",
]

_F = TypeVar("_F")
_GiB = 1024**3


def _accelerator() -> Any:
    """The accelerator, typed by what is asked of it (the memory calls are its subclasses')."""
    return get_accelerator()


# --- small helpers --------------------------------------------------------------------------------------


def noop_decorator(func: _F) -> _F:
    """``func`` itself."""
    return func


class noop_context:
    """A context manager that does nothing (``with noop_context():``)."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        return None


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``"base(arg, ..., key=value)"``, each argument by its ``repr``."""
    parts = [repr(a) for a in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct value of ``items``.

    Raises:
        RuntimeError: ``items`` holds no value, or more than one distinct value.
    """
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def ensure_directory_exists(filename: str) -> None:
    """Create the directory ``filename`` goes in, with its parents (nothing for a bare file name)."""
    directory = os.path.dirname(filename)
    if directory:
        os.makedirs(directory, exist_ok=True)


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when NumPy is installed; modulo 2**32) and torch's
    (modulo 2**63), as DeepSpeed does."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass  # no NumPy, no NumPy generator to seed
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def prefix_sum_inc(weights: Iterable[Any]) -> list[Any]:
    """The inclusive prefix sums of ``weights``: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    sums: list[Any] = []
    for w in weights:
        sums.append(w if not sums else sums[-1] + w)
    return sums


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """The ``num_parts + 1`` boundaries that split ``num_items`` into parts whose sizes differ by at most one,
    the larger parts first (with fewer items than parts, one item per part and then empty parts)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """The ``num_parts + 1`` boundaries of a split of ``weights`` into contiguous parts, chosen as DeepSpeed's
    dynamic programme chooses them: each prefix's best split minimizes (heaviest part - lightest part),
    extending the best split of a shorter prefix, ties to the longest such prefix. With no more weights
    than parts, :func:`partition_uniform`."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (cost, heaviest, lightest) of the split of the first i weights into j parts; where[i][j]:
    # where its last part starts. (0, 0) is the empty split, whose lightest part is +inf.
    best = [[(inf, inf, inf)] * (m + 1) for _ in range(n + 1)]
    where = [[0] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                heaviest, lightest = max(best[k][j - 1][1], part), min(best[k][j - 1][2], part)
                cost = heaviest - lightest
                if best[i][j][0] >= cost:
                    best[i][j] = (cost, heaviest, lightest)
                    where[i][j] = k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(where[bounds[-1]][j])
    return bounds[::-1]


# --- tensors and parameters -----------------------------------------------------------------------------


def is_model_parallel_parameter(p: Any) -> bool:
    """Whether ``p`` is marked as split by model parallelism (``p.model_parallel`` or
    ``p.tensor_model_parallel`` set and true)."""
    return bool(getattr(p, "model_parallel", False)) or bool(getattr(p, "tensor_model_parallel", False))


def filter_empty_parameters(params: Any) -> Any:
    """``params`` (a list or tuple of parameters, or of parameter-group dicts) without its zero-element
    parameters, in the same form; a group left with none is dropped. Anything else comes back as it is."""
    if not isinstance(params, (list, tuple)) or len(params) == 0:
        return params
    if not isinstance(params[0], dict):
        return [p for p in params if p.numel() > 0]
    kept = []
    for group in params:
        nonempty = [p for p in group.get("params", []) if p.numel() > 0]
        if nonempty:
            kept.append({**{k: v for k, v in group.items() if k != "params"}, "params": nonempty})
    return kept


def copy_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool]) -> Any:
    """``item`` with each leaf that ``criterion_func`` accepts copied to ``device`` (``.to(device)``), through
    lists, tuples and dicts (rebuilt); other leaves as they are."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, list):
        return [copy_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` moved to ``device`` through lists, tuples and dicts (rebuilt).

    With ``criterion_func``, a leaf it accepts is moved in place (its ``.data`` now lives on ``device``: the
    same tensor object comes back) and any other leaf gets ``.to(device)``; without, every leaf gets
    ``.to(device)``, so every leaf must have one (DeepSpeed's contract).
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)


def get_tensor_bytes(item: Any) -> int:
    """The bytes of the tensors in ``item`` (a tensor, or lists, tuples and dicts of them); 0 for the rest."""
    if torch.is_tensor(item):
        return item.numel() * item.element_size()
    if isinstance(item, (list, tuple)):
        return sum(get_tensor_bytes(v) for v in item)
    if isinstance(item, dict):
        return sum(get_tensor_bytes(v) for v in item.values())
    return 0


def align_dense_tensors(tensor_list: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    """``tensor_list`` plus a zero tensor (the first tensor's device and dtype) that brings the total element
    count to a multiple of ``alignment``; ``tensor_list`` itself when it already is one."""
    remainder = sum(t.numel() for t in tensor_list) % alignment
    if not remainder:
        return tensor_list
    first = tensor_list[0]
    return [*tensor_list, torch.zeros(alignment - remainder, device=first.device, dtype=first.dtype)]


# --- memory ---------------------------------------------------------------------------------------------


def get_ma_status() -> int:
    """The accelerator's allocated bytes on rank 0 (and without a process group); 0 on the other ranks."""
    if comm.is_initialized() and comm.get_rank() != 0:
        return 0
    return int(_accelerator().memory_allocated())


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak-memory statistics."""
    accelerator = _accelerator()
    accelerator.empty_cache()
    accelerator.reset_peak_memory_stats()


@surface.accepted("prints a memory line on one rank; zeroshard's library never prints")
def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """Does nothing: DeepSpeed's only effect is a printed line (use ``see_memory_usage(msg, force=True)``)."""


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, on rank 0: collect garbage, log ``message`` and the accelerator's and the host's
    memory at INFO on :data:`deepspeed.utils.logger`, then reset the peak statistics. Without ``force``
    it does nothing, as DeepSpeed's."""
    if not force or (comm.is_initialized() and comm.get_rank() != 0):
        return
    gc.collect()  # the figures should not count garbage Python has not collected yet
    accelerator = _accelerator()
    logger.info("%s", message)
    logger.info(
        "MA %s GB Max_MA %s GB CA %s GB Max_CA %s GB",
        round(accelerator.memory_allocated() / _GiB, 2),
        round(accelerator.max_memory_allocated() / _GiB, 2),
        round(accelerator.memory_reserved() / _GiB, 2),
        round(accelerator.max_memory_reserved() / _GiB),
    )
    page = os.sysconf("SC_PAGE_SIZE")
    total, available = page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    used = total - available
    percent = round(100 * used / total, 1)
    logger.info("CPU Virtual Memory:  used = %s GB, percent = %s%%", round(used / _GiB, 2), percent)
    accelerator.reset_peak_memory_stats()


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
