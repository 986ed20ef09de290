"""Rules on the validated config: errors across settings, warnings for settings and features without
effect, and the one validation of the optimizer and scheduler params.

Errors mirror what DeepSpeed rejects (fp16 with bf16, partial offload below stage 3, ...); warnings
point at settings DeepSpeed silently ignores, and at DeepSpeed settings zeroshard does not implement
(see [Note: settings without effect]); the warnings for out-of-scope features are
`scope_warnings.py`.

[Note: settings without effect]
Some DeepSpeed keys ask for a behaviour zeroshard does not have. Each warns, naming the key, its value
and what zeroshard does instead, but only when the value asks for something other than what zeroshard
does (a default never warns):
- `gradient_allreduce_op: "sum"`: zeroshard always averages gradients over the ranks;
- `data_types.buffer_dtype`: zeroshard casts floating-point buffers to the compute dtype under fp16/bf16
  and leaves them as they are in fp32 (`fp32` there does not warn);
- `sparse_gradients: true`: gradients are reduced dense;
- `fp16.fp16_master_weights_and_grads`, `bf16.bf16_master_weights_and_grads`,
  `bf16.bf16_optimizer_states: true`: master weights, the gradients they are stepped with and the
  optimizer state stay fp32;
- `memory_breakdown: true`: no allocator log; the `steps_per_print` line and
  `engine.memory_breakdown()` report this rank's bytes instead.
`data_types.param_dtype` is honoured when it names the precision mode's dtype and an error otherwise
(DeepSpeed 0.19.8 rejects the mismatch too). `bf16.immediate_grad_update` never warns: zeroshard moves
each gradient out of `param.grad` as soon as autograd produces it, which is what `true` asks for, and
`false` (the default) only delays DeepSpeed's fp32 accumulation within a backward, without changing a
value.

[Note: one validation]
`optimizer.params` and `scheduler.params` are keyword arguments of a constructor, so only building the
optimizer and the schedule checks them fully (keys, kinds, finiteness, the ranges the class itself
enforces, such as a negative lr). `load_config` therefore builds both with the very functions
`initialize()` uses (`build_optimizer`, `build_scheduler`) over a one-element stand-in parameter at the
config's ZeRO stage, and records any `TypeError`/`ValueError` as a config problem. `zeroshard check-config`
calls `load_config`, so it refuses exactly what `initialize()` refuses, with the same message. The config
block is checked even when `initialize()` is given a client optimizer or scheduler (which it then uses
instead): a broken block is a broken config. What the config alone cannot decide is left to
`initialize()`: a per-param-group list (`warmup_max_lr: [a, b]`) must have one value per group of the
model's optimizer; the stand-in has as many groups as the first such list has values, so here the values
are checked and the lists against each other, and `initialize()` checks the length against the model.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from zeroshard.config.blocks import FP16Config
from zeroshard.config.errors import Problems, show
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.scope import NO_EFFECT
from zeroshard.config.scope_warnings import value_at
from zeroshard.lr_schedules import build_scheduler
from zeroshard.optim_factory import build_optimizer

__all__ = ["check_config", "fp16_scale_problems"]


def fp16_scale_problems(fp16: FP16Config) -> list[str]:
    """DeepSpeed's rule for the ``fp16`` block: dynamic loss scaling (enabled, ``loss_scale`` 0) needs a
    positive ``loss_scale_window`` and ``min_loss_scale``; a static scale, or fp16 off, leaves them unused."""
    if not (fp16.enabled and fp16.loss_scale == 0):
        return []
    found = []
    if fp16.loss_scale_window <= 0:
        found.append(
            f"fp16.loss_scale_window: {fp16.loss_scale_window} is not allowed; expected a value > 0 "
            "with dynamic loss scaling (loss_scale 0)"
        )
    if fp16.min_loss_scale <= 0:
        found.append(
            f"fp16.min_loss_scale: {fp16.min_loss_scale:g} is not allowed; expected a value > 0 "
            "with dynamic loss scaling (loss_scale 0)"
        )
    return found


def _precision(cfg: ZeroshardConfig, problems: Problems) -> None:
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.add(
            "fp16.enabled and bf16.enabled are both true; enable one of them (DeepSpeed rejects this too)"
        )
    fp16 = cfg.fp16
    for problem in fp16_scale_problems(fp16):
        problems.add(problem)
    needs_zero = (
        ("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", cfg.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states),
    )
    for key, value in needs_zero:
        if value and stage == 0:
            problems.add(f"{key}: true needs zero_optimization.stage 1, 2 or 3 (it is 0)")
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.add("bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads: true")


def _offload(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    zero = cfg.zero_optimization
    for name, block in (("offload_param", zero.offload_param), ("offload_optimizer", zero.offload_optimizer)):
        if block.device == "nvme" and not block.nvme_path:
            problems.add(f'zero_optimization.{name}.nvme_path: required when device is "nvme"')
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        problems.add(
            f"zero_optimization.offload_optimizer.ratio: {zero.offload_optimizer.ratio:g} is not allowed at "
            f"stage {zero.stage}; partial offload needs stage 3"
        )
    if zero.offload_param.device != "none" and zero.stage != 3:
        notes.append(
            f"zero_optimization.offload_param has no effect at stage {zero.stage}: parameters are only "
            f"offloaded at stage 3 (DeepSpeed ignores it too)"
        )
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append(
            "zero_optimization.offload_optimizer has no effect at stage 0 (DeepSpeed ignores it too)"
        )


def _grad_norm(cfg: ZeroshardConfig, problems: Problems) -> None:
    """`zero_optimization.compute_grad_norm: false` where DeepSpeed 0.19.8 allows it (stages 1-2, no clipping,
    no optimizer offload, no ZenFlow)."""
    zero = cfg.zero_optimization
    if zero.compute_grad_norm:
        return
    needs = {
        f"zero_optimization.stage {zero.stage}; it needs stage 1 or 2": zero.stage not in (1, 2),
        f"gradient_clipping {cfg.gradient_clipping:g}; it needs 0": cfg.gradient_clipping > 0,
        "zero_optimization.offload_optimizer; it needs none": zero.offload_optimizer.device != "none",
        "zero_optimization.zenflow; it needs none": zero.zenflow is not None,
    }
    for conflict, present in needs.items():
        if present:
            problems.add(f"zero_optimization.compute_grad_norm: false is not allowed with {conflict}")


def _allreduce_op(cfg: ZeroshardConfig, problems: Problems) -> None:
    if cfg.gradient_allreduce_op != "sum":
        return
    if cfg.zero_optimization.stage == 3:
        problems.add(
            'gradient_allreduce_op: "sum" is not supported with ZeRO stage 3 (zero_optimization.stage 3); '
            'expected "mean"'
        )
    if cfg.zero_optimization.zenflow is not None:
        problems.add('gradient_allreduce_op: "sum" is not supported with ZenFlow (zero_optimization.zenflow)')
    if cfg.compile.get("deepcompile"):
        problems.add('gradient_allreduce_op: "sum" is not supported with DeepCompile (compile.deepcompile)')


def _compute_dtype(cfg: ZeroshardConfig) -> str:
    return "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"


def _data_types(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    compute = _compute_dtype(cfg)
    param_dtype, buffer_dtype = cfg.data_types.param_dtype, cfg.data_types.buffer_dtype
    if param_dtype is not None and param_dtype != compute:
        switch = {"fp16": "fp16.enabled", "bf16": "bf16.enabled"}.get(param_dtype)
        fix = f"set {switch}: true" if switch else "disable fp16 and bf16"
        problems.add(
            f"data_types.param_dtype: {show(param_dtype)} is not allowed with {compute} training; expected "
            f"{show(compute)} or no data_types.param_dtype, or {fix} (DeepSpeed 0.19.8 rejects this too)"
        )
    if buffer_dtype is not None and buffer_dtype != compute:
        instead = (
            "leaves buffers in the dtype the model has them in (fp32 training)"
            if compute == "fp32"
            else f"casts floating-point buffers to the compute dtype, {compute}"
        )
        notes.append(f"data_types.buffer_dtype: {show(buffer_dtype)} has no effect: zeroshard {instead}")


def _hybrid(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    """``mics_shard_size`` (core/hybrid.py [Note: hybrid sharding]); whether it divides the world size is
    checked where the world size is known (``initialize``)."""
    zero = cfg.zero_optimization
    size = zero.mics_shard_size
    if size < -1:
        problems.add(
            f"zero_optimization.mics_shard_size: {size} is not allowed; expected -1 (off) or a group size "
            ">= 1"
        )
    if size <= 0:
        return
    if zero.stage == 0:
        notes.append("zero_optimization.mics_shard_size has no effect at stage 0: nothing is sharded")
    for name in ("offload_optimizer", "offload_param"):
        if getattr(zero, name).device != "none" and zero.stage >= (3 if name == "offload_param" else 1):
            problems.add(
                f"zero_optimization.mics_shard_size: {size} with zero_optimization.{name}.device "
                f"{getattr(zero, name).device!r} is not supported: hybrid sharding keeps the state in device "
                "memory (DeepSpeed's MiCS refuses offloading too)"
            )


def _hpz(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    """``zero_hpz_partition_size`` (core/hybrid.py [Note: hpZ groups]); divisibility: at ``initialize``."""
    zero, size = cfg.zero_optimization, cfg.zero_optimization.zero_hpz_partition_size
    key = f"zero_optimization.zero_hpz_partition_size: {size}"
    if size > 1 and zero.stage < 3:
        notes.append(f"{key} has no effect at stage {zero.stage}: only stage 3 gathers parameters")
    elif size > 1:
        others = [f"mics_shard_size: {zero.mics_shard_size}"] if zero.mics_shard_size > 0 else []
        devices = {name: getattr(zero, name).device for name in ("offload_optimizer", "offload_param")}
        others += [f"{name}.device {device!r}" for name, device in devices.items() if device != "none"]
        for other in others:
            problems.add(f"{key} with zero_optimization.{other} is not supported: use one or the other")


def _quantized(cfg: ZeroshardConfig, notes: list[str]) -> None:
    """ZeRO++'s quantized collectives (core/quantize.py [Note: quantized collectives]): stage 3 only."""
    zero = cfg.zero_optimization
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if getattr(zero, key) and zero.stage < 3:
            notes.append(
                f"zero_optimization.{key}: true has no effect at stage {zero.stage}: ZeRO++ quantizes "
                "stage 3's parameter gathers and gradient reduce-scatters"
            )


def _without_effect(cfg: ZeroshardConfig, notes: list[str]) -> None:
    """Warnings for settings zeroshard does not implement (see [Note: settings without effect])."""
    for key, value, instead in NO_EFFECT:
        if value_at(cfg, key) == value:
            notes.append(f"{key}: {show(value)} has no effect: {instead}")


_BUILDER_LOGGERS = (
    "zeroshard.optim_factory",
    "zeroshard.lr_schedules",
    "zeroshard.lr_schedules.base",
    "zeroshard.lr_schedules.cycle",
    "zeroshard.lr_schedules.warmup",
)


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextmanager
def _quiet_builders() -> Iterator[None]:
    """Silences the builders' log lines and warnings during the trial build; `initialize()` repeats the
    build and logs them once, for the real optimizer."""
    drop = _DropAll()
    loggers = [logging.getLogger(name) for name in _BUILDER_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


_PER_GROUP_KEYS = (
    "warmup_min_lr",
    "warmup_max_lr",
    "lr_range_test_min_lr",
    "base_lr",
    "max_lr",
    "base_momentum",
    "max_momentum",
    "cycle_min_lr",
    "cycle_max_lr",
    "cycle_min_mom",
    "cycle_max_mom",
)
"""Schedule params that may hold one value per param group (DeepSpeed's and torch's schedules)."""


def _group_count(params: dict[str, Any]) -> int:
    """Param groups of the stand-in optimizer: the length of the first per-group list, else 1."""
    for key in _PER_GROUP_KEYS:
        value = params.get(key)
        if isinstance(value, list | tuple) and 1 <= len(value) <= 64:
            return len(value)
    return 1


def _has_auto(params: Mapping[str, Any]) -> bool:
    """Whether "auto" is left in `params`: `resolve_auto` has then recorded why it could not resolve it."""
    return any(isinstance(value, str) and value == "auto" for value in params.values())


def _optimizer_and_scheduler(cfg: ZeroshardConfig, problems: Problems) -> None:
    """Builds the config's optimizer and schedule over a stand-in parameter (see [Note: one validation])."""
    if cfg.optimizer is None and cfg.scheduler is None:
        return
    groups: list[dict[str, Any]] = [
        {"params": [torch.zeros(1)]}
        for _ in range(_group_count(cfg.scheduler.params if cfg.scheduler else {}))
    ]
    optimizer: torch.optim.Optimizer | None = None
    with _quiet_builders():
        if cfg.optimizer is not None and not _has_auto(cfg.optimizer.params):
            stage = cfg.zero_optimization.stage
            try:
                optimizer = build_optimizer(cfg.optimizer.type, cfg.optimizer.params, groups, stage=stage)
            except (TypeError, ValueError) as err:
                problems.add(str(err), type_error=isinstance(err, TypeError))
        if cfg.scheduler is not None and not _has_auto(cfg.scheduler.params):
            # Without a usable optimizer block (the client's optimizer drives the schedule), AdamW stands in.
            stand_in = optimizer if optimizer is not None else torch.optim.AdamW(groups, lr=1e-3)
            try:
                build_scheduler(cfg.scheduler.type, cfg.scheduler.params, stand_in)
            except (TypeError, ValueError) as err:
                problems.add(str(err), type_error=isinstance(err, TypeError))


def _needs_optimizer(cfg: ZeroshardConfig, problems: Problems) -> None:
    """Without an optimizer from `initialize()`, what needs the config's `optimizer` block."""
    if cfg.optimizer is not None:
        return
    if cfg.scheduler is not None:
        problems.add(
            "scheduler: a 'scheduler' block needs an optimizer: add an 'optimizer' block or pass optimizer= "
            "to initialize()"
        )
    zero = cfg.zero_optimization
    if zero.offload_optimizer.device == "nvme" and zero.stage >= 1:
        problems.add(
            "zero_optimization.offload_optimizer.device: \"nvme\" needs an optimizer: add an 'optimizer' "
            "block or pass optimizer= to initialize()"
        )


def check_config(
    cfg: ZeroshardConfig, problems: Problems, notes: list[str], *, optimizer_given: bool = False
) -> None:
    """Records cross-setting errors in `problems` and warnings about ignored settings in `notes`.

    Args:
        cfg: The validated config.
        problems: Where errors are recorded.
        notes: Where warnings are recorded.
        optimizer_given: Whether `initialize()` was given an optimizer (object or callable).
    """
    if not optimizer_given:
        _needs_optimizer(cfg, problems)
    _precision(cfg, problems)
    _offload(cfg, problems, notes)
    _hybrid(cfg, problems, notes)
    _hpz(cfg, problems, notes)
    _quantized(cfg, notes)
    _allreduce_op(cfg, problems)
    _grad_norm(cfg, problems)
    _data_types(cfg, problems, notes)
    _without_effect(cfg, notes)
    _optimizer_and_scheduler(cfg, problems)
