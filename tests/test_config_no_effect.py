"""DeepSpeed settings zeroshard does not implement: one warning each, naming the key, the value and what
zeroshard does instead, only when the value asks for something zeroshard does not do (see
[Note: settings without effect] in zeroshard/config/checks.py). Defaults (DeepSpeed 0.19's) never warn."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from zeroshard.config import ConfigError, ConfigWarning, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}
BF16 = {"enabled": True}


def load(cfg: dict[str, Any]) -> tuple[ZeroshardConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({**BATCH, **cfg}, world_size=2)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


# (config, words the single warning contains: key, value, what zeroshard does instead)
WARNS: list[tuple[dict[str, Any], tuple[str, ...]]] = [
    ({"gradient_allreduce_op": "sum"}, ('gradient_allreduce_op: "sum"', "always averages")),
    ({"gradient_allreduce_op": "SUM"}, ('gradient_allreduce_op: "sum"', "always averages")),
    ({"sparse_gradients": True}, ("sparse_gradients: true", "dense")),
    ({"memory_breakdown": True}, ("memory_breakdown: true", "engine.memory_breakdown()")),
    (
        {"zero_optimization": {"stage": 2, "ignore_unused_parameters": False}},
        ("zero_optimization.ignore_unused_parameters: false", "skips a parameter no rank produced one for"),
    ),
    (
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 1}},
        ("fp16.fp16_master_weights_and_grads: true", "master weights", "in fp32"),
    ),
    (
        {"bf16": {**BF16, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
        ("bf16.bf16_master_weights_and_grads: true", "master weights", "in fp32"),
    ),
    (
        {"data_types": {"buffer_dtype": "bf16"}},
        ('data_types.buffer_dtype: "bf16"', "leaves buffers in the dtype the model has them in"),
    ),
    (
        {"bf16": BF16, "data_types": {"buffer_dtype": "float32"}},
        ('data_types.buffer_dtype: "fp32"', "casts floating-point buffers to the compute dtype, bf16"),
    ),
    (
        {"fp16": {"enabled": True}, "data_types": {"buffer_dtype": "bf16"}},
        ('data_types.buffer_dtype: "bf16"', "compute dtype, fp16"),
    ),
]


@pytest.mark.parametrize(("cfg", "words"), WARNS, ids=[words[0] for _, words in WARNS])
def test_setting_without_effect_warns_once(cfg: dict[str, Any], words: tuple[str, ...]) -> None:
    loaded, messages = load(cfg)
    assert len(messages) == 1, messages
    assert "has no effect: zeroshard" in messages[0]
    for word in words:
        assert word in messages[0], (word, messages[0])
    assert loaded.warnings == tuple(messages)


def test_bf16_optimizer_states_warns_with_master_weights() -> None:
    _, messages = load(
        {
            "bf16": {**BF16, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 3},
        }
    )
    assert len(messages) == 2, messages
    assert messages[1].startswith("bf16.bf16_optimizer_states: true has no effect: zeroshard keeps")
    assert "optimizer state in fp32" in messages[1]


QUIET: list[dict[str, Any]] = [
    # DeepSpeed 0.19's defaults, written out.
    {"gradient_allreduce_op": "mean"},
    {"sparse_gradients": False},
    {"memory_breakdown": False},
    {"fp16": {"enabled": True, "fp16_master_weights_and_grads": False}},
    {"bf16": {**BF16, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}},
    {"bf16": {**BF16, "immediate_grad_update": False}},
    {"data_types": {"param_dtype": None, "buffer_dtype": None, "grad_accum_dtype": None}},
    # What zeroshard does anyway.
    {"bf16": {**BF16, "immediate_grad_update": True}},
    {"data_types": {"param_dtype": "fp32", "buffer_dtype": "fp32"}},
    {"bf16": BF16, "data_types": {"param_dtype": "bfloat16", "buffer_dtype": "bf16"}},
    {"fp16": {"enabled": True}, "data_types": {"param_dtype": "half", "buffer_dtype": "torch.float16"}},
    # Implemented: they take effect (tests/test_mixed_precision.py checks how).
    {"bf16": {**BF16, "check_grad_overflow": False}, "communication_data_type": "fp32"},
    {"fp16": {"enabled": True, "auto_cast": True}, "data_types": {"grad_accum_dtype": "bf16"}},
]


@pytest.mark.parametrize("cfg", QUIET, ids=[str(c) for c in QUIET])
def test_defaults_and_what_zeroshard_does_do_not_warn(cfg: dict[str, Any]) -> None:
    _, messages = load(cfg)
    assert messages == []


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (
            {"data_types": {"param_dtype": "bf16"}},
            'data_types.param_dtype: "bf16" is not allowed with fp32 training; expected "fp32" or no '
            "data_types.param_dtype, or set bf16.enabled: true",
        ),
        (
            {"bf16": BF16, "data_types": {"param_dtype": "fp16"}},
            'data_types.param_dtype: "fp16" is not allowed with bf16 training; expected "bf16" or no '
            "data_types.param_dtype, or set fp16.enabled: true",
        ),
        (
            {"fp16": {"enabled": True}, "data_types": {"param_dtype": "float32"}},
            'data_types.param_dtype: "fp32" is not allowed with fp16 training; expected "fp16" or no '
            "data_types.param_dtype, or disable fp16 and bf16",
        ),
    ],
)
def test_param_dtype_must_match_the_precision_mode(cfg: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, **cfg}, world_size=2)
    assert expected in str(info.value)
    assert "DeepSpeed 0.19.8 rejects this too" in str(info.value)


def test_several_settings_give_one_warning_each() -> None:
    _, messages = load({"gradient_allreduce_op": "sum", "sparse_gradients": True, "memory_breakdown": True})
    assert [m.split(":")[0] for m in messages] == [
        "gradient_allreduce_op",
        "sparse_gradients",
        "memory_breakdown",
    ]
