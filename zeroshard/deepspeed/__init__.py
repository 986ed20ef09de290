"""DeepSpeed's module tree over zeroshard: ``import deepspeed`` code runs unchanged.

Reach it as ``import zeroshard.deepspeed as deepspeed``, or let ``import deepspeed`` resolve here with
``zeroshard launch`` or ``ZEROSHARD_AS_DEEPSPEED=1`` (see ``zeroshard_as_deepspeed`` and docs/porting.md,
which lists every covered name). Every name is a thin layer over zeroshard's own code.

``__version__`` is ``0.19.0+zeroshard.<zeroshard version>``: the DeepSpeed release whose API and config
this follows, so version checks such as ``deepspeed>=0.9.3`` pass, with zeroshard's version as a local label.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from zeroshard.config import add_config_arguments
from zeroshard.deepspeed import accelerator, checkpoint, comm, ops, runtime, surface, utils, zero
from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.distributed import TORCH_DISTRIBUTED_DEFAULT_PORT, init_distributed
from zeroshard.deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from zeroshard.deepspeed.runtime.zero.partition_parameters import _mark_stage3_params
from zeroshard.runtime.build import checked_model
from zeroshard.runtime.build import initialize as _initialize
from zeroshard.runtime.engine import ZeroshardEngine as DeepSpeedEngine
from zeroshard.version import __version__ as _zeroshard_version

surface.install()  # the DeepSpeed modules with no file here: [Note: generated surface] in surface.py

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "checkpoint",
    "comm",
    "get_accelerator",
    "init_distributed",
    "initialize",
    "ops",
    "runtime",
    "utils",
    "zero",
]

__version_major__, __version_minor__, __version_patch__ = 0, 19, 0
__version__ = f"{__version_major__}.{__version_minor__}.{__version_patch__}+zeroshard.{_zeroshard_version}"
__git_hash__ = None
__git_branch__ = None


def initialize(
    args: argparse.Namespace | None = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer | None, Any, Any]:
    """``deepspeed.initialize`` with DeepSpeed 0.19's signature (argument order included).

    Joins the process group (``init_distributed(distributed_port=...)``); with ``dist_init_required=False``
    the group must be initialized already (``UsageError`` otherwise, as DeepSpeed asserts). Then builds
    the engine with :func:`zeroshard.initialize`. At ZeRO stage 3 each trained parameter
    gets DeepSpeed's ``ds_numel``, ``ds_shape``, ``ds_id`` and ``ds_status`` attributes (see
    docs/porting.md). Collective: call on all ranks.
    """
    if mesh_param is not None:
        raise ValueError("initialize(mesh_param=...): tensor/sequence parallel meshes are not supported")
    checked_model(model, mpu)  # before joining, as DeepSpeed asserts the model first
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    engine, opt, loader, sched = _initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=False,
        collate_fn=collate_fn,
        config=config,
        config_params=config_params,
    )
    _mark_stage3_params(engine)
    return engine, opt, loader, sched


__getattr__ = surface.fallback(__name__)
