"""DeepSpeed features zeroshard does not implement: one warning per feature a config turns on.

[Note: out-of-scope features] A feature counts as turned on (rules also in docs/config.md):
- blocks with an `enabled` switch (flops_profiler, torch_autocast, amp, progressive_layer_drop,
  eigenvalue, curriculum_learning, data_efficiency, quantize_training, expert_parallel, elasticity,
  autotuning, hybrid_engine, nebula): when `enabled` is true;
- blocks without one (activation_checkpointing, compile, tensor_parallel, pipeline): when any value
  differs from DeepSpeed's default;
- sparse_attention, zenflow, datastates_ckpt, weight_quantization: when present (DeepSpeed turns them on
  by presence; weight_quantization unless `enabled: false`);
- compression_training: when any technique's `shared_parameters.enabled` (or layer_reduction.enabled) is true;
- ZeRO++ (zero_quantized_*, zero_hpz_partition_size > 1, zeropp_loco_param), MiCS (mics_shard_size > 0,
  mics_hierarchical_params_gather), SuperOffload (offload_optimizer.super_offload), sequence parallelism
  (sequence_parallel_size > 1, data_parallel_size, seq_parallel_communication_data_type not fp32), and
  DeepSpeed-internal ZeRO and engine switches: when set to a non-default value.
The config still loads; the warning names the settings that have no effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from zeroshard.config.base import Block
from zeroshard.config.errors import show
from zeroshard.config.schema import ZeroshardConfig

__all__ = ["out_of_scope_warnings"]

_PIPELINE_DEFAULTS = {
    "stages": "auto",
    "partition": "best",
    "seed_layers": False,
    "activation_checkpoint_interval": 0,
    "pipe_partitioned": True,
    "grad_partitioned": True,
}
_COMPRESSION_TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
_ZERO_PLUS_PLUS = (
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "zero_hpz_partition_size",
    "zeropp_loco_param",
)
_MICS = ("mics_shard_size", "mics_hierarchical_params_gather")
_ZERO_INTERNALS = (
    "legacy_stage1",
    "elastic_checkpoint",
    "use_multi_rank_bucket_allreduce",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "memory_efficient_linear",
    "pipeline_loading_checkpoint",
    "override_module_apply",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory",
)
_ENGINE_SWITCHES = (
    "managed_gradient_accumulation",
    "disable_allgather",
    "dump_state",
    "graph_harvesting",
    "use_data_before_expert_parallelism",
)


def _changed(block: Block, prefix: str, names: tuple[str, ...] | None = None) -> Iterator[str]:
    """Yields "prefix.field=value" for each field of `block` (or of `names`) that differs from its default."""
    default = type(block)()
    for name in names or tuple(type(block).model_fields):
        value = getattr(block, name)
        if value == getattr(default, name):
            continue
        if isinstance(value, Block):
            yield from _changed(value, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}={show(value)}"


def _enabled(cfg: ZeroshardConfig, key: str) -> list[str]:
    block = getattr(cfg, key)
    value = block.get("enabled") if isinstance(block, Mapping) else getattr(block, "enabled", None)
    return [f"{key}.enabled=true"] if value is True else []


def _pipeline(cfg: ZeroshardConfig) -> list[str]:
    block = cfg.pipeline or {}
    return [f"pipeline.{k}={show(v)}" for k, v in block.items() if _PIPELINE_DEFAULTS.get(k, object()) != v]


def _compression(cfg: ZeroshardConfig) -> list[str]:
    block = cfg.compression_training or {}
    found = []
    for name in _COMPRESSION_TECHNIQUES:
        shared = (block.get(name) or {}).get("shared_parameters") or {}
        if shared.get("enabled") is True:
            found.append(f"compression_training.{name}.shared_parameters.enabled=true")
    if ((block.get("layer_reduction") or {}).get("enabled")) is True:
        found.append("compression_training.layer_reduction.enabled=true")
    return found


def _present(cfg: ZeroshardConfig, key: str) -> list[str]:
    value = getattr(cfg, key)
    if key == "weight_quantization" and isinstance(value, Mapping) and value.get("enabled") is False:
        return []
    return [key] if value is not None and value is not False else []


def _zero(cfg: ZeroshardConfig, names: tuple[str, ...]) -> list[str]:
    return list(_changed(cfg.zero_optimization, "zero_optimization", names))


def _sequence_parallel(cfg: ZeroshardConfig) -> list[str]:
    found = []
    if cfg.sequence_parallel_size is not None and cfg.sequence_parallel_size > 1:
        found.append(f"sequence_parallel_size={cfg.sequence_parallel_size}")
    if cfg.data_parallel_size is not None:
        found.append(f"data_parallel_size={cfg.data_parallel_size}")
    if cfg.seq_parallel_communication_data_type != "fp32":
        found.append(f"seq_parallel_communication_data_type={show(cfg.seq_parallel_communication_data_type)}")
    return found


def _engine(cfg: ZeroshardConfig) -> list[str]:
    defaults = {name: ZeroshardConfig.model_fields[name].default for name in _ENGINE_SWITCHES}
    return [
        f"{name}={show(getattr(cfg, name))}"
        for name in _ENGINE_SWITCHES
        if getattr(cfg, name) != defaults[name]
    ]


_Rule = Callable[[ZeroshardConfig], list[str]]
_FEATURES: tuple[tuple[str, _Rule], ...] = (
    ("pipeline parallelism", _pipeline),
    ("tensor parallelism (AutoTP)", lambda c: list(_changed(c.tensor_parallel, "tensor_parallel"))),
    ("the FLOPs profiler", lambda c: _enabled(c, "flops_profiler")),
    ("ZeRO++", lambda c: _zero(c, _ZERO_PLUS_PLUS)),
    ("MiCS", lambda c: _zero(c, _MICS)),
    ("ZenFlow", lambda c: ["zero_optimization.zenflow"] if c.zero_optimization.zenflow is not None else []),
    (
        "SuperOffload",
        lambda c: (
            ["zero_optimization.offload_optimizer.super_offload=true"]
            if c.zero_optimization.offload_optimizer.super_offload
            else []
        ),
    ),
    ("DeepSpeed-internal ZeRO switches", lambda c: _zero(c, _ZERO_INTERNALS)),
    ("sparse attention", lambda c: _present(c, "sparse_attention")),
    ("compression training", _compression),
    ("quantize-aware training (MoQ)", lambda c: _enabled(c, "quantize_training")),
    ("inference weight quantization", lambda c: _present(c, "weight_quantization")),
    (
        "DeepSpeed activation checkpointing",
        lambda c: list(_changed(c.activation_checkpointing, "activation_checkpointing")),
    ),
    ("eigenvalue computation", lambda c: _enabled(c, "eigenvalue")),
    ("progressive layer drop", lambda c: _enabled(c, "progressive_layer_drop")),
    ("curriculum learning", lambda c: _enabled(c, "curriculum_learning")),
    ("the data efficiency library", lambda c: _enabled(c, "data_efficiency")),
    ("elastic training", lambda c: _enabled(c, "elasticity")),
    ("the autotuner", lambda c: _enabled(c, "autotuning")),
    ("Apex AMP", lambda c: _enabled(c, "amp")),
    ("torch.autocast", lambda c: _enabled(c, "torch_autocast")),
    ("DeepSpeed compile", lambda c: list(_changed(c.compile, "compile"))),
    ("sequence parallelism", _sequence_parallel),
    ("expert parallelism (AutoEP)", lambda c: _enabled(c, "expert_parallel")),
    ("the hybrid engine", lambda c: _enabled(c, "hybrid_engine")),
    ("Nebula checkpointing", lambda c: _enabled(c, "nebula")),
    ("DataStates checkpointing", lambda c: _present(c, "datastates_ckpt")),
    ("DeepSpeed engine switches", _engine),
)


def out_of_scope_warnings(cfg: ZeroshardConfig) -> list[str]:
    """One message per out-of-scope feature `cfg` turns on (see [Note: out-of-scope features])."""
    messages = []
    for feature, rule in _FEATURES:
        settings = rule(cfg)
        if settings:
            listed = ", ".join(settings)
            messages.append(
                f"{feature} is not supported by zeroshard; these settings have no effect: {listed}"
            )
    return messages
