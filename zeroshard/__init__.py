"""zeroshard: ZeRO data-parallel training for PyTorch with DeepSpeed's API and exact numerics."""

from __future__ import annotations

from zeroshard import zero
from zeroshard.config import ZeroshardConfig, add_config_arguments
from zeroshard.core.liveness import CollectiveError
from zeroshard.core.memory import MemoryBreakdown
from zeroshard.core.stage3.module_marks import register_external_parameter, set_z3_leaf_modules
from zeroshard.dist import init_distributed, shutdown_distributed
from zeroshard.runtime.build import initialize
from zeroshard.runtime.engine import ZeroshardEngine
from zeroshard.version import __version__

__all__ = [
    "CollectiveError",
    "MemoryBreakdown",
    "ZeroshardConfig",
    "ZeroshardEngine",
    "__version__",
    "add_config_arguments",
    "init_distributed",
    "initialize",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "shutdown_distributed",
    "zero",
]
