"""Deprecated spellings: read as the current key, with exactly one warning each."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest

from zeroshard.config import ConfigError, ConfigTypeError, ConfigWarning, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}


def load(cfg: dict[str, Any]) -> tuple[ZeroshardConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({**BATCH, **cfg}, world_size=2)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def attr(cfg: ZeroshardConfig, dotted: str) -> Any:
    value: Any = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize(
    ("cfg", "checks", "mentions"),
    [
        ({"bfloat16": {"enabled": True}}, {"bf16.enabled": True}, ("bfloat16", "bf16")),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": True}},
            {"zero_optimization.offload_optimizer.device": "cpu"},
            ("cpu_offload", "offload_optimizer"),
        ),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload": False}},
            {"zero_optimization.offload_optimizer.device": "none"},
            ("cpu_offload", "offload_optimizer"),
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_param": True}},
            {"zero_optimization.offload_param.device": "cpu"},
            ("cpu_offload_param", "offload_param"),
        ),
        (
            {"zero_optimization": {"stage": 3, "cpu_offload_params": True}},
            {"zero_optimization.offload_param.device": "cpu"},
            ("cpu_offload_params", "offload_param"),
        ),
        (
            {"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}},
            {"zero_optimization.gather_16bit_weights_on_model_save": True},
            ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
        ),
        ({"zero_optimization": True}, {"zero_optimization.stage": 1}, ("zero_optimization: true", "stage")),
        ({"zero_optimization": False}, {"zero_optimization.stage": 0}, ("zero_optimization: false",)),
        (
            {"zero_optimization": True, "allgather_size": 1e7},
            {"zero_optimization.stage": 1, "zero_optimization.allgather_bucket_size": 10_000_000},
            ("zero_optimization: true", "allgather_bucket_size"),
        ),
        (
            {"aio": {"thread_count": 4}},
            {"aio.intra_op_parallelism": 4},
            ("aio.thread_count", "intra_op_parallelism"),
        ),
        (
            {"aio": {"thread_count": 4, "intra_op_parallelism": 4}},
            {"aio.intra_op_parallelism": 4},
            ("thread_count",),
        ),
        (
            {"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": True}},
            {},
            ("cpu_offload_use_pin_memory",),
        ),
    ],
)
def test_deprecated_key_is_mapped_with_one_warning(
    cfg: dict[str, Any], checks: dict[str, Any], mentions: tuple[str, ...]
) -> None:
    loaded, messages = load(cfg)
    assert len(messages) == 1, messages
    assert "deprecated" in messages[0]
    for word in mentions:
        assert word in messages[0]
    for dotted, value in checks.items():
        assert attr(loaded, dotted) == value, dotted


def test_pin_memory_flag_applies_to_the_blocks_it_governed() -> None:
    loaded, messages = load(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload": True,
                "cpu_offload_param": True,
                "cpu_offload_use_pin_memory": False,
            }
        }
    )
    assert len(messages) == 3  # one per deprecated key
    zero = loaded.zero_optimization
    assert (zero.offload_optimizer.device, zero.offload_optimizer.pin_memory) == ("cpu", False)
    assert (zero.offload_param.device, zero.offload_param.pin_memory) == ("cpu", False)


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"bfloat16": {"enabled": True}, "bf16": {"enabled": True}}, "bfloat16: given together with bf16"),
        (
            {"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.cpu_offload: given together with zero_optimization.offload_optimizer",
        ),
        (
            {"zero_optimization": {"cpu_offload_param": True, "offload_param": {"device": "cpu"}}},
            "zero_optimization.cpu_offload_param: given together with zero_optimization.offload_param",
        ),
        (
            {"zero_optimization": {"cpu_offload_param": True, "cpu_offload_params": True}},
            "zero_optimization.cpu_offload_params: given together with zero_optimization.cpu_offload_param",
        ),
        (
            {
                "zero_optimization": {
                    "stage3_gather_fp16_weights_on_model_save": True,
                    "stage3_gather_16bit_weights_on_model_save": False,
                }
            },
            "stage3_gather_fp16_weights_on_model_save: given together with "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
        ({"aio": {"thread_count": 2, "intra_op_parallelism": 4}}, "aio.thread_count: 2 contradicts"),
    ],
)
def test_deprecated_and_current_key_together_is_an_error(cfg: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=r"given together|contradicts") as info:
        load_config({**BATCH, **cfg}, world_size=2)
    assert needle in str(info.value)


def test_deprecated_flag_must_be_boolean() -> None:
    with pytest.raises(
        ConfigTypeError, match=re.escape('zero_optimization.cpu_offload: "cpu" is not allowed')
    ):
        load_config({**BATCH, "zero_optimization": {"cpu_offload": "cpu"}}, world_size=2)
