"""The plain values ``zeroshard.core`` takes, read from the validated config.

``core/`` reads no config (``tests/test_imports.py`` holds it to importing nothing outside ``core/``): the
assembly (``build.py``) turns the config into a :class:`~zeroshard.core.precision.DtypePolicy`, a
:class:`~zeroshard.core.loss_scaler.LossScaler` and :class:`~zeroshard.core.units.UnitRules` here, and
hands them down.
"""

from __future__ import annotations

import torch

from zeroshard.config import ZeroshardConfig
from zeroshard.core.loss_scaler import LossScaler
from zeroshard.core.precision import DTYPES, DtypePolicy
from zeroshard.core.units import UnitRules


def _dtype(key: str, value: str) -> torch.dtype:
    if value not in DTYPES:
        raise ValueError(f"{key}: {value!r} is not allowed; expected one of {', '.join(DTYPES)}")
    return DTYPES[value]


def policy_from_config(cfg: ZeroshardConfig) -> DtypePolicy:
    """The dtype policy a resolved config asks for (see [Note: dtype vocabulary] in core/precision.py)."""
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
    compute = torch.float16 if cfg.fp16.enabled else torch.bfloat16 if cfg.bf16.enabled else torch.float32
    reduce = compute
    if cfg.communication_data_type is not None:
        reduce = _dtype("communication_data_type", cfg.communication_data_type)
    accumulate = torch.float32 if cfg.gradient_accumulation_steps > 1 else compute
    if cfg.data_types.grad_accum_dtype is not None:
        accumulate = _dtype("data_types.grad_accum_dtype", cfg.data_types.grad_accum_dtype)
    return DtypePolicy(compute=compute, master=torch.float32, reduce=reduce, accumulate=accumulate)


def loss_scaler_from_config(cfg: ZeroshardConfig) -> LossScaler | None:
    """The fp16 loss scaler (None unless fp16 is enabled): dynamic when ``fp16.loss_scale`` is 0."""
    if not cfg.fp16.enabled:
        return None
    fp16 = cfg.fp16
    if fp16.loss_scale > 0:
        return LossScaler.static(fp16.loss_scale)
    return LossScaler.dynamic_from(
        initial_scale_power=fp16.initial_scale_power,
        window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
    )


def unit_rules_from_config(cfg: ZeroshardConfig) -> UnitRules:
    """How ``build_units`` groups parameters into units, from ``zero_optimization``."""
    zero = cfg.zero_optimization
    return UnitRules(
        reduce_bucket_size=zero.reduce_bucket_size,
        param_persistence_threshold=zero.param_persistence_threshold,
        module_granularity_threshold=zero.module_granularity_threshold,
        leaf_class_names=tuple(zero.leaf_module.classes),
        leaf_names=tuple(zero.leaf_module.names),
        leaf_name_suffixes=tuple(zero.leaf_module.name_suffixes),
    )
