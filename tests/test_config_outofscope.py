"""Features zeroshard does not implement: accepted, and one warning per feature that is turned on."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from zeroshard.config import ConfigWarning, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}


def load(cfg: dict[str, Any]) -> tuple[ZeroshardConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({**BATCH, **cfg}, world_size=2)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# (config turning the feature on, words the single warning contains, config with the block but off)
FEATURES: list[tuple[dict[str, Any], tuple[str, ...], dict[str, Any]]] = [
    (
        {"pipeline": {"stages": 2, "partition": "uniform"}},
        ("pipeline parallelism", "pipeline.stages=2"),
        {"pipeline": {"stages": "auto", "partition": "best"}},
    ),
    (
        {"tensor_parallel": {"autotp_size": 4}},
        ("tensor parallelism", "tensor_parallel.autotp_size=4"),
        {"tensor_parallel": {"autotp_size": 0}},
    ),
    (
        {"flops_profiler": {"enabled": True, "profile_step": 3}},
        ("FLOPs profiler", "flops_profiler.enabled=true"),
        {"flops_profiler": {"enabled": False, "profile_step": 3}},
    ),
    (
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
        ("ZeRO++", "zero_quantized_nontrainable_weights=true"),
        # zero_hpz_partition_size (hpZ) and the quantized collectives are implemented
        {
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_weights": True,
                "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 1,
            }
        },
    ),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"err_beta": 0.8}}}, ("ZeRO++",), {}),
    (
        {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}},
        ("ZenFlow",),
        {"zero_optimization": {"stage": 2}},
    ),
    (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": True}}},
        ("SuperOffload",),
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": False}}},
    ),
    (
        {"zero_optimization": {"stage": 1, "legacy_stage1": True}},
        ("DeepSpeed-internal ZeRO", "legacy_stage1=true"),
        {"zero_optimization": {"stage": 1, "legacy_stage1": False}},
    ),
    ({"sparse_attention": {"mode": "fixed", "block": 16}}, ("sparse attention",), {}),
    (
        {
            "compression_training": {
                "weight_quantization": {"shared_parameters": {"enabled": True}, "different_groups": {}}
            }
        },
        ("compression training", "weight_quantization.shared_parameters.enabled=true"),
        {"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}}},
    ),
    ({"quantize_training": {"enabled": True}}, ("MoQ",), {"quantize_training": {"enabled": False}}),
    (
        {"weight_quantization": {"quantized_initialization": {}}},
        ("weight quantization",),
        {"weight_quantization": {"enabled": False}},
    ),
    (
        {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}},
        ("activation checkpointing", "partition_activations=true", "cpu_checkpointing=true"),
        {"activation_checkpointing": {"partition_activations": False}},
    ),
    ({"eigenvalue": {"enabled": True}}, ("eigenvalue",), {"eigenvalue": {"enabled": False, "max_iter": 50}}),
    (
        {"progressive_layer_drop": {"enabled": True, "theta": 0.5}},
        ("progressive layer drop",),
        {"progressive_layer_drop": {"enabled": False}},
    ),
    (
        {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
        ("curriculum learning",),
        {"curriculum_learning": {"enabled": False}},
    ),
    (
        {"data_efficiency": {"enabled": True, "data_sampling": {}}},
        ("data efficiency",),
        {"data_efficiency": {"enabled": False}},
    ),
    (
        {"autotuning": {"enabled": True, "fast": False}},
        ("autotuner",),
        {"autotuning": {"enabled": False, "fast": False}},
    ),
    (
        {"amp": {"enabled": True, "opt_level": "O2"}},
        ("Apex AMP",),
        {"amp": {"enabled": False, "opt_level": "O2"}},
    ),
    (
        {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
        ("torch.autocast",),
        {"torch_autocast": {"enabled": False, "dtype": "bfloat16"}},
    ),
    (
        {"compile": {"deepcompile": True}},
        ("DeepSpeed compile", "compile.deepcompile=true"),
        {"compile": {"deepcompile": False}},
    ),
    (
        {"sequence_parallel_size": 4},
        ("sequence parallelism", "sequence_parallel_size=4"),
        {"sequence_parallel_size": 1},
    ),
    (
        {"seq_parallel_communication_data_type": "bf16"},
        ("sequence parallelism",),
        {"seq_parallel_communication_data_type": "fp32"},
    ),
    (
        {"expert_parallel": {"enabled": True, "autoep_size": 4}},
        ("AutoEP",),
        {"expert_parallel": {"enabled": False}},
    ),
    ({"hybrid_engine": {"enabled": True}}, ("hybrid engine",), {"hybrid_engine": {"enabled": False}}),
    (
        {"nebula": {"enabled": True, "persistent_storage_path": "/x"}},
        ("Nebula",),
        {"nebula": {"enabled": False}},
    ),
    ({"datastates_ckpt": {"host_cache_size": 16}}, ("DataStates",), {"datastates_ckpt": False}),
    (
        {"comet": {"enabled": True, "project": "p"}},
        ("Comet monitor", "comet.enabled=true"),
        {"comet": {"enabled": False, "project": "p"}},
    ),
    (
        {"managed_gradient_accumulation": False, "graph_harvesting": True},
        ("engine switches", "managed_gradient_accumulation=false", "graph_harvesting=true"),
        {"managed_gradient_accumulation": True, "graph_harvesting": False},
    ),
]


@pytest.mark.parametrize(("cfg", "words", "off"), FEATURES, ids=[words[0] for _, words, _ in FEATURES])
def test_feature_turned_on_warns_once(
    cfg: dict[str, Any], words: tuple[str, ...], off: dict[str, Any]
) -> None:
    loaded, messages = load(cfg)
    assert len(messages) == 1, messages
    assert "not supported by zeroshard" in messages[0] and "no effect" in messages[0]
    for word in words:
        assert word in messages[0], (word, messages[0])
    assert loaded.warnings == tuple(messages)
    _, quiet = load(off)
    assert quiet == []


def test_several_features_give_one_warning_each() -> None:
    _, messages = load(
        {
            "flops_profiler": {"enabled": True},
            "tensor_parallel": {"autotp_size": 2},
            "zero_optimization": {
                "stage": 3,
                "zero_quantized_nontrainable_weights": True,
                "zeropp_loco_param": {"err_beta": 0.8},
            },
        }
    )
    assert len(messages) == 3
    assert sum("ZeRO++" in message for message in messages) == 1


def test_out_of_scope_blocks_are_still_validated() -> None:
    with pytest.raises(TypeError, match=r"flops_profiler\.enabled: \"yes\" is not allowed"):
        load_config({**BATCH, "flops_profiler": {"enabled": "yes"}}, world_size=2)
    with pytest.raises(ValueError, match=r"zero_optimization\.zenflow\.topk_ratio: 1.5 is not allowed"):
        load_config({**BATCH, "zero_optimization": {"zenflow": {"topk_ratio": 1.5}}}, world_size=2)
