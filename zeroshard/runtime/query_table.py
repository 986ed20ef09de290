"""DeepSpeed's engine config queries as data (``queries.DeepSpeedQueries`` is made from the table).

[Note: engine queries]
``DeepSpeedEngine`` answers some hundred ``engine.<name>()`` questions about its config
(``zero_reduce_bucket_size()``, ``gradient_clipping()``, ``zero_offload_optimizer()``, ...). :data:`QUERIES`
maps each DeepSpeed name to how it reads zeroshard's resolved config
(:class:`~zeroshard.config.ZeroshardConfig`, which mirrors the ds_config key by key), and
:class:`DeepSpeedQueries` has one method per entry, made from the table, with DeepSpeed's name, no arguments
and a docstring saying what it reads. The answers are DeepSpeed 0.19.8's for the same ds_config, with the
same JSON types (``tests/test_engine_queries.py`` compares them with a real DeepSpeed). Where DeepSpeed
returns one of its pydantic blocks, zeroshard returns its own block for that key (the same fields and
values), or ``None`` where DeepSpeed does; the entry's docstring notes every other difference.

The engine methods DeepSpeed has and zeroshard neither implements (here, ``methods.py``,
``surface.py``, ``engine.py``) nor forwards to the model are refused at use (refused.py).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.config import ZeroshardConfig
from zeroshard.core.precision import DTYPES

__all__ = ["QUERIES", "Query"]


@dataclass(frozen=True)
class Query:
    """How zeroshard answers one of DeepSpeed's config queries.

    Attributes:
        read: The answer, from the resolved config. Containers are fresh copies: changing one does not
            change the config.
        reads: What it reads, for the docstring ("the config's ``fp16.loss_scale``").
        note: How the answer differs from DeepSpeed's, if it can.
    """

    read: Callable[[ZeroshardConfig], Any]
    reads: str
    note: str = ""


def _at(path: str) -> Query:
    """The value at dotted ``path`` of the config (typed blocks and feature blocks alike)."""

    def read(config: ZeroshardConfig) -> Any:
        value: Any = config
        for key in path.split("."):
            value = value[key]
        return copy.deepcopy(value) if isinstance(value, dict | list) else value

    return Query(read, f"the config's ``{path}``")


def _is(reads: str, read: Callable[[ZeroshardConfig], Any], note: str = "") -> Query:
    return Query(read, reads, note)


def _constant(value: Any, why: str) -> Query:
    return Query(lambda _: value, f"``{value!r}``: {why}")


def _offloaded(config: ZeroshardConfig) -> Any:
    """``zero_optimization.offload_optimizer``, or None when nothing is offloaded (DeepSpeed's None)."""
    block = config.zero_optimization.offload_optimizer
    return block if block.device != "none" else None


def _offload_param(config: ZeroshardConfig) -> Any:
    block = config.zero_optimization.offload_param
    return block if block.device != "none" else None


_NO_BLOCK = (
    ' DeepSpeed returns its block for ``{"device": "none"}`` given explicitly; zeroshard cannot tell that '
    "from an absent block and returns None."
)


def _autotuning_path(key: str, file: str) -> Query:
    return _is(
        f"the config's ``autotuning.{key}``, else ``{file}`` in the working directory",
        lambda c: c.autotuning[key] or os.path.join(os.getcwd(), file),
    )


def _flops_profiler_step(config: ZeroshardConfig) -> Any:
    if config.autotuning["enabled"]:
        return config.autotuning["start_profile_step"]
    return config.flops_profiler["profile_step"]


def _passes(config: ZeroshardConfig) -> list[str]:
    return list(config.compile["passes"] or [])


def _data_efficiency(config: ZeroshardConfig) -> dict[str, Any]:
    """The ``data_efficiency`` block with DeepSpeed's defaults filled in, as DeepSpeed's config holds it."""
    given: dict[str, Any] = copy.deepcopy(config.data_efficiency or {})
    sampling_given = given.get("data_sampling", {})
    curriculum_given = sampling_given.get("curriculum_learning", {})
    curriculum = {"enabled": curriculum_given.get("enabled", False)}
    if curriculum["enabled"]:
        curriculum.update({k: v for k, v in curriculum_given.items() if k != "enabled"})
    batching = dict(sampling_given.get("dynamic_batching", {}))
    batching["enabled"] = bool(batching.get("enabled", False))
    batching["lr_scaling_method"] = str(batching.get("lr_scaling_method", "linear"))
    batching["min_batch_size"] = int(batching.get("min_batch_size", 1))
    batching["max_batch_size"] = int(batching["max_batch_size"]) if "max_batch_size" in batching else None
    batching["sequence_picking_order"] = str(batching.get("sequence_picking_order", "dataloader"))
    if batching["enabled"] and "max_tokens" in batching:
        batching["max_tokens"] = int(batching["max_tokens"])
    batching["verbose"] = bool(batching.get("verbose", False))
    sampling = {
        **sampling_given,
        "enabled": sampling_given.get("enabled", False),
        "num_epochs": sampling_given.get("num_epochs", 1000),
        "num_workers": sampling_given.get("num_workers", 0),
        "pin_memory": sampling_given.get("pin_memory", False),
        "curriculum_learning": curriculum,
        "dynamic_batching": batching,
    }
    routing_given = given.get("data_routing", {})
    ltd_given = routing_given.get("random_ltd", {})
    ltd: dict[str, Any] = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    if ltd_given.get("enabled", False):
        ltd.update({k: v for k, v in ltd_given.items() if k != "enabled"}, enabled=True)
    return {
        "enabled": given.get("enabled", False),
        "seed": given.get("seed", 1234),
        "data_sampling": sampling,
        "data_routing": {"enabled": routing_given.get("enabled", False), "random_ltd": ltd},
    }


def _efficiency(reads: str, *path: str) -> Query:
    def read(config: ZeroshardConfig) -> Any:
        value: Any = _data_efficiency(config)
        for key in path:
            value = value[key]
        return value

    return _is(f"{reads} (the ``data_efficiency`` block with DeepSpeed's defaults)", read)


_AUTOCAST_SAFE = [
    f"{m.__module__}.{m.__name__}"
    for m in (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
]
"""DeepSpeed's default ``torch_autocast.lower_precision_safe_modules``."""

_ZERO_KEYS = {
    "zero_allgather_bucket_size": "allgather_bucket_size",
    "zero_allgather_partitions": "allgather_partitions",
    "zero_allgather_sequential": "allgather_sequential",
    "zero_compute_grad_norm": "compute_grad_norm",
    "zero_contiguous_gradients": "contiguous_gradients",
    "zero_elastic_checkpoint": "elastic_checkpoint",
    "zero_hpz_partition_size": "zero_hpz_partition_size",
    "zero_ignore_unused_parameters": "ignore_unused_parameters",
    "zero_legacy_stage1": "legacy_stage1",
    "zero_load_from_fp32_weights": "load_from_fp32_weights",
    "zero_log_trace_cache_warnings": "log_trace_cache_warnings",
    "zero_max_live_parameters": "max_live_parameters",
    "zero_max_reuse_distance": "max_reuse_distance",
    "zero_model_persistence_threshold": "model_persistence_threshold",
    "zero_module_granularity_threshold": "module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "zero_overlap_comm": "overlap_comm",
    "zero_parameter_alignment": "parameter_alignment",
    "zero_param_persistence_threshold": "param_persistence_threshold",
    "zero_prefetch_bucket_size": "prefetch_bucket_size",
    "zero_quantized_gradients": "zero_quantized_gradients",
    "zero_quantized_nontrainable_weights": "zero_quantized_nontrainable_weights",
    "zero_quantized_weights": "zero_quantized_weights",
    "zero_reduce_bucket_size": "reduce_bucket_size",
    "zero_reduce_scatter": "reduce_scatter",
    "zero_round_robin_gradients": "round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory": "save_muon_momentum_buffer_in_memory",
    "zero_sub_group_size": "sub_group_size",
    "is_sanity_checks_enabled": "enable_sanity_checks",
    "zenflow_config": "zenflow",
}
"""The queries that read one ``zero_optimization`` key: DeepSpeed's name -> the key."""

_TOP_LEVEL_KEYS = (
    "dataloader_drop_last",
    "dump_state",
    "gradient_clipping",
    "gradient_predivide_factor",
    "log_level",
    "managed_gradient_accumulation",
    "steps_per_print",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
)
"""The queries named like the top-level key they read."""

QUERIES: dict[str, Query] = {
    **{name: _at(name) for name in _TOP_LEVEL_KEYS},
    **{name: _at(f"zero_optimization.{key}") for name, key in _ZERO_KEYS.items()},
    # -- the step --------------------------------------------------------------------------------------
    "postscale_gradients": _is("not the config's ``prescale_gradients``", lambda c: not c.prescale_gradients),
    "wall_clock_breakdown": _is(
        "the config's ``wall_clock_breakdown``, or ``flops_profiler.enabled``",
        lambda c: c.wall_clock_breakdown | c.flops_profiler["enabled"],
    ),
    # -- precision -------------------------------------------------------------------------------------
    "fp16_auto_cast": _at("fp16.auto_cast"),
    "fp16_master_weights_and_gradients": _at("fp16.fp16_master_weights_and_grads"),
    "bf16_master_weights_and_gradients": _at("bf16.bf16_master_weights_and_grads"),
    "bf16_optimizer_states": _at("bf16.bf16_optimizer_states"),
    "loss_scale": _at("fp16.loss_scale"),
    "dynamic_loss_scale": _is("whether ``fp16.loss_scale`` is 0", lambda c: c.fp16.loss_scale == 0),
    "initial_dynamic_scale": _is(
        "2 ** ``fp16.initial_scale_power``", lambda c: 2**c.fp16.initial_scale_power
    ),
    "dynamic_loss_scale_args": _is(
        "the dynamic loss scaler's settings from the ``fp16`` block, under DeepSpeed's names (init_scale, "
        "scale_window, delayed_shift, consecutive_hysteresis, min_scale)",
        lambda c: {
            "init_scale": 2**c.fp16.initial_scale_power,
            "scale_window": c.fp16.loss_scale_window,
            "delayed_shift": c.fp16.hysteresis,
            "consecutive_hysteresis": c.fp16.consecutive_hysteresis,
            "min_scale": int(c.fp16.min_loss_scale)
            if c.fp16.min_loss_scale.is_integer()
            else c.fp16.min_loss_scale,
        },
    ),
    "torch_autocast_enabled": _at("torch_autocast.enabled"),
    "torch_autocast_dtype": _is(
        "the config's ``torch_autocast.dtype`` as a ``torch.dtype`` (None when unset)",
        lambda c: DTYPES.get(c.torch_autocast["dtype"]),
    ),
    "torch_autocast_lower_precision_safe_modules": _is(
        "the config's ``torch_autocast.lower_precision_safe_modules``, else DeepSpeed's default (Linear "
        "and Conv1d-3d)",
        lambda c: list(c.torch_autocast["lower_precision_safe_modules"] or _AUTOCAST_SAFE),
    ),
    # -- optimizer and schedule ------------------------------------------------------------------------
    "optimizer_params": _is(
        "the config's ``optimizer.params`` (None without an optimizer block)",
        lambda c: copy.deepcopy(c.optimizer.params) if c.optimizer is not None else None,
        "DeepSpeed returns None for an optimizer block without ``params``; zeroshard returns {}.",
    ),
    "optimizer_legacy_fusion": _is(
        "the config's ``optimizer.legacy_fusion`` (False without an optimizer block)",
        lambda c: c.optimizer.legacy_fusion if c.optimizer is not None else False,
    ),
    "scheduler_name": _is(
        "the config's ``scheduler.type`` (None without a scheduler block)",
        lambda c: c.scheduler.type if c.scheduler is not None else None,
    ),
    "scheduler_params": _is(
        "the config's ``scheduler.params`` (None without a scheduler block)",
        lambda c: copy.deepcopy(c.scheduler.params) if c.scheduler is not None else None,
    ),
    # -- ZeRO ------------------------------------------------------------------------------------------
    "zero_optimization_partition_weights": _is(
        "whether ``zero_optimization.stage`` is 3", lambda c: c.zero_optimization.stage >= 3
    ),
    "is_first_weights_partition_group": _is(
        "whether ``zero_optimization.stage`` is 3", lambda c: c.zero_optimization.stage >= 3
    ),
    "zero_offload_optimizer": _is(
        "the config's ``zero_optimization.offload_optimizer`` block, None when its device is none",
        _offloaded,
        _NO_BLOCK,
    ),
    "zero_offload_param": _is(
        "the config's ``zero_optimization.offload_param`` block, None when its device is none",
        _offload_param,
        _NO_BLOCK,
    ),
    "zero_use_cpu_optimizer": _is(
        "whether ``zero_optimization.offload_optimizer.device`` is cpu or nvme",
        lambda c: c.zero_optimization.offload_optimizer.device in ("cpu", "nvme"),
    ),
    "zero_cpu_offload": _is(
        "whether ``zero_optimization.offload_optimizer.device`` is cpu",
        lambda c: c.zero_optimization.offload_optimizer.device == "cpu",
    ),
    "zero_nvme_offload_optimizer": _is(
        "whether ``zero_optimization.offload_optimizer.device`` is nvme (DeepSpeed reads its optimizer's "
        "swap flag, set for exactly that)",
        lambda c: c.zero_optimization.offload_optimizer.device == "nvme",
    ),
    "zero_partial_offload": _is(
        "``zero_optimization.offload_optimizer.ratio`` (1.0 without optimizer offload)",
        lambda c: _offloaded(c).ratio if _offloaded(c) is not None else 1.0,
    ),
    "super_offload": _is(
        "``zero_optimization.offload_optimizer.super_offload`` (False without optimizer offload)",
        lambda c: _offloaded(c).super_offload if _offloaded(c) is not None else False,
    ),
    "cpuadam_cores_perc": _is(
        "``zero_optimization.offload_optimizer.cpuadam_cores_perc`` (0.9 without optimizer offload, as "
        "DeepSpeed answers then)",
        lambda c: _offloaded(c).cpuadam_cores_perc if _offloaded(c) is not None else 0.9,
    ),
    # -- checkpoints and I/O ---------------------------------------------------------------------------
    "checkpoint_serialization_enabled": _at("checkpoint.checkpoint_serialization"),
    "checkpoint_writer_enabled": _is(
        "whether the config has a ``checkpoint.writer`` block", lambda c: c.checkpoint.writer is not None
    ),
    "checkpoint_tag_validation_enabled": _is(
        "whether ``checkpoint.tag_validation`` is not IGNORE",
        lambda c: c.checkpoint.tag_validation != "IGNORE",
    ),
    "checkpoint_tag_validation_fail": _is(
        "whether ``checkpoint.tag_validation`` is FAIL", lambda c: c.checkpoint.tag_validation == "FAIL"
    ),
    "load_universal_checkpoint": _at("checkpoint.load_universal"),
    "use_node_local_storage": _at("checkpoint.use_node_local_storage"),
    "aio_config": _is("the config's ``aio`` block as a dict", lambda c: c.aio.model_dump()),
    # -- features zeroshard does not have: their settings, as DeepSpeed reads them ------------------------
    "flops_profiler_enabled": _is(
        "the config's ``flops_profiler.enabled``, or ``autotuning.enabled``",
        lambda c: c.flops_profiler["enabled"] or c.autotuning["enabled"],
    ),
    "flops_profiler_recompute_fwd_factor": _at("flops_profiler.recompute_fwd_factor"),
    "flops_profiler_profile_step": _is(
        "the config's ``flops_profiler.profile_step`` (``autotuning.start_profile_step`` when autotuning)",
        _flops_profiler_step,
    ),
    "flops_profiler_module_depth": _at("flops_profiler.module_depth"),
    "flops_profiler_top_modules": _at("flops_profiler.top_modules"),
    "flops_profiler_detailed": _is(
        "the config's ``flops_profiler.detailed`` (False when autotuning)",
        lambda c: False if c.autotuning["enabled"] else c.flops_profiler["detailed"],
    ),
    "flops_profiler_output_file": _at("flops_profiler.output_file"),
    "autotuning_enabled": _at("autotuning.enabled"),
    "autotuning_start_profile_step": _at("autotuning.start_profile_step"),
    "autotuning_end_profile_step": _at("autotuning.end_profile_step"),
    "autotuning_metric": _at("autotuning.metric"),
    "autotuning_metric_path": _autotuning_path("metric_path", "autotuning_metric.json"),
    "autotuning_model_info_path": _autotuning_path("model_info_path", "autotuning_model_info.json"),
    "autotuning_profile_model_info": _is(
        "``autotuning.enabled and autotuning.model_info and autotuning.model_info.get('profile', False)``",
        lambda c: (
            c.autotuning["enabled"]
            and c.autotuning["model_info"]
            and c.autotuning["model_info"].get("profile", False)
        ),
    ),
    "tensor_parallel_config": _is(
        "the config's ``tensor_parallel`` block (a dict with DeepSpeed's defaults; DeepSpeed returns its "
        "pydantic block with the same fields)",
        lambda c: copy.copy(c.tensor_parallel),
    ),
    "autotp_size": _at("tensor_parallel.autotp_size"),
    "is_deepcompile_enabled": _at("compile.deepcompile"),
    "is_deepcompile_active": _constant(False, "zeroshard never runs DeepCompile"),
    "compile_zero_optimization_stage": _is(
        'whether ``compile.passes`` has "z1" or "z3"',
        lambda c: "z1" in _passes(c) or "z3" in _passes(c),
        "DeepSpeed 0.19.8 raises TypeError when ``compile.passes`` is unset; zeroshard answers False.",
    ),
    "compile_autosp": _is('whether ``compile.passes`` has "autosp"', lambda c: "autosp" in _passes(c)),
    "compile_autotp": _is('whether ``compile.passes`` has "autotp"', lambda c: "autotp" in _passes(c)),
    "uses_parallelization_pass_only": _is(
        'whether ``compile.passes`` has "autosp" or "autotp"',
        lambda c: "autosp" in _passes(c) or "autotp" in _passes(c),
    ),
    "data_efficiency_enabled": _efficiency("``enabled``", "enabled"),
    "data_efficiency_config": _efficiency("the block"),
    "data_sampling_enabled": _efficiency("``data_sampling.enabled``", "data_sampling", "enabled"),
    "data_sampling_config": _efficiency("``data_sampling``", "data_sampling"),
    "curriculum_learning_enabled": _efficiency(
        "``data_sampling.curriculum_learning.enabled``", "data_sampling", "curriculum_learning", "enabled"
    ),
    "curriculum_learning_config": _efficiency(
        "``data_sampling.curriculum_learning``", "data_sampling", "curriculum_learning"
    ),
    "random_ltd_enabled": _efficiency(
        "``data_routing.random_ltd.enabled``", "data_routing", "random_ltd", "enabled"
    ),
    "random_ltd_config": _efficiency("``data_routing.random_ltd``", "data_routing", "random_ltd"),
}
"""DeepSpeed's config queries: ``DeepSpeedEngine`` method name -> how zeroshard answers it."""
