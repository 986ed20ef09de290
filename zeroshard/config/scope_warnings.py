"""Warnings for DeepSpeed features outside zeroshard's scope that a config turns on.

[Note: out-of-scope features] A feature counts as turned on (rules also in docs/config.md):
- blocks with an `enabled` switch (flops_profiler, torch_autocast, amp, progressive_layer_drop,
  eigenvalue, curriculum_learning, data_efficiency, quantize_training, expert_parallel, autotuning,
  hybrid_engine, nebula): when `enabled` is true;
- blocks without one (activation_checkpointing, compile, tensor_parallel, pipeline): when any value
  differs from DeepSpeed's default;
- sparse_attention, zenflow, datastates_ckpt, weight_quantization: when present (DeepSpeed turns them on
  by presence; weight_quantization unless `enabled: false`);
- compression_training: when any technique's `shared_parameters.enabled` (or layer_reduction.enabled) is true;
- ZeRO++'s quantized frozen weights and LoCo (zero_quantized_nontrainable_weights, zeropp_loco_param),
  SuperOffload (offload_optimizer.super_offload), sequence parallelism
  (sequence_parallel_size > 1, data_parallel_size, seq_parallel_communication_data_type not fp32), and
  DeepSpeed-internal ZeRO and engine switches: when set to a non-default value.
The config still loads; the warning names the settings that have no effect.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from zeroshard.config.blocks import Block
from zeroshard.config.errors import show
from zeroshard.config.features import FEATURE_BLOCKS
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.scope import OUT_OF_SCOPE, Feature

__all__ = ["out_of_scope_warnings", "value_at"]

_COMPRESSION_TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
_MISSING = object()


def _default_of(block: Block, name: str) -> Any:
    return type(block).model_fields[name].get_default(call_default_factory=True)


def _changed(
    block: Any, prefix: str, names: tuple[str, ...], defaults: Mapping[str, Any] | None
) -> Iterator[str]:
    """Yields "prefix.key=value" for each setting of `block` (or of `names`) that differs from its default.

    `block` is a typed `Block` or a feature block (a dict, compared with `defaults`; a key without a
    default counts as changed)."""
    head = f"{prefix}." if prefix else ""
    if isinstance(block, Block):
        for name in names or tuple(type(block).model_fields):
            value, default = getattr(block, name), _default_of(block, name)
            if value == default:
                continue
            if isinstance(value, Block):
                yield from _changed(value, f"{head}{name}", (), None)
            else:
                yield f"{head}{name}={show(value)}"
        return
    defaults = defaults or {}
    for name, value in block.items():
        if names and name not in names:
            continue
        default = defaults.get(name, _MISSING)
        if value == default:
            continue
        if isinstance(value, Mapping) and isinstance(default, Mapping):
            yield from _changed(value, f"{head}{name}", (), default)
        else:
            yield f"{head}{name}={show(value)}"


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


def _sequence_parallel(cfg: ZeroshardConfig) -> list[str]:
    found = []
    if cfg.sequence_parallel_size is not None and cfg.sequence_parallel_size > 1:
        found.append(f"sequence_parallel_size={cfg.sequence_parallel_size}")
    if cfg.data_parallel_size is not None:
        found.append(f"data_parallel_size={cfg.data_parallel_size}")
    if cfg.seq_parallel_communication_data_type != "fp32":
        found.append(f"seq_parallel_communication_data_type={show(cfg.seq_parallel_communication_data_type)}")
    return found


_CUSTOM = {"compression training": _compression, "sequence parallelism": _sequence_parallel}


def value_at(cfg: ZeroshardConfig, dotted: str) -> Any:
    """The config's value at a dotted path (``"zero_optimization.stage"``), through blocks and mappings."""
    value: Any = cfg
    for part in dotted.split(".") if dotted else ():
        value = value.get(part) if isinstance(value, Mapping) else getattr(value, part)
    return value


def _turned_on(cfg: ZeroshardConfig, feature: Feature) -> list[str]:
    """The settings by which `cfg` turns `feature` on (see `features.Feature`); empty when it does not."""
    if feature.on == "custom":
        return _CUSTOM[feature.name](cfg)
    block = value_at(cfg, feature.at)
    if feature.on == "enabled":
        value = block.get("enabled") if isinstance(block, Mapping) else getattr(block, "enabled", None)
        return [f"{feature.at}.enabled=true"] if value is True else []
    if feature.on == "present":
        off = (
            block is None or block is False or (isinstance(block, Mapping) and block.get("enabled") is False)
        )
        return [] if off else [feature.at]
    if block is None:
        return []
    defaults = feature.defaults
    if defaults is None and feature.at in FEATURE_BLOCKS:
        defaults = FEATURE_BLOCKS[feature.at].defaults()
    return list(_changed(block, feature.at, feature.settings, defaults))


def out_of_scope_warnings(cfg: ZeroshardConfig) -> list[str]:
    """One message per out-of-scope feature `cfg` turns on (see [Note: out-of-scope features])."""
    messages = []
    for feature in OUT_OF_SCOPE:
        settings = _turned_on(cfg, feature)
        if settings:
            listed = ", ".join(settings)
            messages.append(
                f"{feature.name} is not supported by zeroshard; these settings have no effect: {listed}"
            )
    return messages
