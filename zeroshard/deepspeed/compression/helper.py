"""``deepspeed.compression.helper``: ``recursive_getattr`` and ``recursive_setattr``, which DeepSpeed-Chat
imports from here.

DeepSpeed 0.19 keeps this module only as a deprecated alias of ``deepspeed.utils.module_utils`` and warns
(``FutureWarning``) when it is imported; so does this one, once per process, as any module import.
"""

from __future__ import annotations

import warnings

from zeroshard.deepspeed import surface
from zeroshard.deepspeed.utils.module_utils import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]

warnings.warn(
    "deepspeed.compression.helper is deprecated (DeepSpeed 0.19): import recursive_getattr and "
    "recursive_setattr from deepspeed.utils.module_utils",
    FutureWarning,
    stacklevel=2,
)

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
