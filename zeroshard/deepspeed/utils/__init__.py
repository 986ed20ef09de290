"""``deepspeed.utils``: ``logger``, ``log_dist``, the ``safe_get_full_*`` / ``safe_set_full_*`` accessors,
``RepeatingLoader`` (defined in ``deepspeed.runtime.dataloader``) and ``recursive_getattr`` /
``recursive_setattr`` (defined in ``deepspeed.utils.module_utils``)."""

from __future__ import annotations

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.runtime.dataloader import RepeatingLoader
from zeroshard.deepspeed.utils.logging import log_dist, logger, print_rank_0
from zeroshard.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr
from zeroshard.deepspeed.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
)
from zeroshard.deepspeed.utils.z3_leaf_module import set_z3_leaf_modules

__all__ = [
    "RepeatingLoader",
    "log_dist",
    "logger",
    "print_rank_0",
    "recursive_getattr",
    "recursive_setattr",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "set_z3_leaf_modules",
]

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
