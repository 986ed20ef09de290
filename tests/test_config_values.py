"""Wrong types, out-of-range values and contradictory settings: one clear line each."""

from __future__ import annotations

import math
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


def problem(cfg: dict[str, Any], error: type[Exception] = ConfigError) -> str:
    with pytest.raises(error) as info:
        load_config({**BATCH, **cfg}, world_size=2)
    lines = str(info.value).splitlines()
    assert len(lines) == 2, lines  # header + exactly one problem
    return lines[1].removeprefix("  - ")


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (
            {"zero_optimization": {"stage": 5}},
            "zero_optimization.stage: 5 is not allowed; expected one of 0, 1, 2, 3",
        ),
        (
            {"zero_optimization": {"stage": -1}},
            "zero_optimization.stage: -1 is not allowed; expected one of 0, 1, 2, 3",
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            'zero_optimization.offload_param.device: "gpu" is not allowed; '
            "expected one of 'none', 'cpu', 'nvme'",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 0}},
            "zero_optimization.reduce_bucket_size: 0 is not allowed; expected a value > 0",
        ),
        (
            {"zero_optimization": {"allgather_bucket_size": -1}},
            "zero_optimization.allgather_bucket_size: -1 is not allowed; expected a value >= 0",
        ),
        (
            {"zero_optimization": {"reduce_bucket_size": 5.5}},
            "zero_optimization.reduce_bucket_size: 5.5 is not allowed; expected an integer",
        ),
        (
            {"zero_optimization": {"stage3_max_live_parameters": -5}},
            "zero_optimization.stage3_max_live_parameters: -5 is not allowed; expected a value >= 0",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 1.5}}},
            "zero_optimization.offload_optimizer.ratio: 1.5 is not allowed; expected a value <= 1.0",
        ),
        ({"gradient_clipping": -1}, "gradient_clipping: -1 is not allowed; expected a value >= 0.0"),
        (
            {"gradient_clipping": math.inf},
            "gradient_clipping: Infinity is not allowed; expected a finite number",
        ),
        (
            {"gradient_predivide_factor": 0},
            "gradient_predivide_factor: 0 is not allowed; expected a value > 0.0",
        ),
        ({"fp16": {"loss_scale": -2}}, "fp16.loss_scale: -2 is not allowed; expected a value >= 0.0"),
        ({"steps_per_print": 0}, "steps_per_print: 0 is not allowed; expected a value >= 1"),
        (
            {"communication_data_type": "fp8"},
            "communication_data_type: \"fp8\" is not allowed; expected one of 'fp32', 'fp16', 'bf16'",
        ),
        (
            {"checkpoint": {"tag_validation": "maybe"}},
            "checkpoint.tag_validation: \"MAYBE\" is not allowed; expected one of 'WARN', 'IGNORE', 'FAIL'",
        ),
        (
            {"gradient_allreduce_op": "max"},
            "gradient_allreduce_op: \"max\" is not allowed; expected one of 'mean', 'sum'",
        ),
        ({"aio": {"block_size": 0}}, "aio.block_size: 0 is not allowed; expected a value > 0"),
    ],
)
def test_out_of_range_values(cfg: dict[str, Any], expected: str) -> None:
    assert problem(cfg) == expected


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (
            {"zero_optimization": {"stage": "3"}},
            'zero_optimization.stage: "3" is not allowed; expected an integer',
        ),
        (
            {"zero_optimization": {"stage": True}},
            "zero_optimization.stage: true is not allowed; expected an integer",
        ),
        (
            {"zero_optimization": {"overlap_comm": "yes"}},
            'zero_optimization.overlap_comm: "yes" is not allowed; expected true or false',
        ),
        ({"fp16": {"enabled": 2}}, "fp16.enabled: 2 is not allowed; expected true or false"),
        ({"gradient_clipping": "1.0"}, 'gradient_clipping: "1.0" is not allowed; expected a number'),
        ({"zero_optimization": 2}, "zero_optimization: 2 is not allowed; expected an object ({...})"),
        ({"fp16": True}, "fp16: true is not allowed; expected an object ({...})"),
        (
            {"optimizer": {"type": "Adam", "params": [1e-3]}},
            "optimizer.params: [0.001] is not allowed; expected an object ({...})",
        ),
        ({"tensorboard": {"output_path": 5}}, "tensorboard.output_path: 5 is not allowed; expected a string"),
        (
            {"zero_optimization": {"leaf_module": {"classes": [1]}}},
            "zero_optimization.leaf_module.classes: [1] is not allowed; expected a list of strings",
        ),
    ],
)
def test_wrong_types_raise_type_errors(cfg: dict[str, Any], expected: str) -> None:
    assert problem(cfg, ConfigTypeError) == expected


def test_type_errors_are_also_value_errors() -> None:
    with pytest.raises(ValueError):
        load_config({**BATCH, "fp16": {"enabled": "yes"}}, world_size=2)
    with pytest.raises(TypeError):
        load_config({**BATCH, "fp16": {"enabled": "yes"}}, world_size=2)


def test_required_optimizer_type() -> None:
    assert problem({"optimizer": {"params": {"lr": 1e-3}}}) == "optimizer.type: required key is missing"


def test_case_insensitive_choices_and_dtype_spellings() -> None:
    cfg, _ = load(
        {
            "communication_data_type": "BF16",
            "data_types": {"grad_accum_dtype": "torch.float32"},
            "checkpoint": {"tag_validation": "ignore"},
            "gradient_allreduce_op": "MEAN",
        }
    )
    assert cfg.communication_data_type == "bf16"
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert cfg.checkpoint.tag_validation == "IGNORE"
    assert cfg.gradient_allreduce_op == "mean"


def test_bools_accept_zero_and_one() -> None:
    cfg, _ = load({"zero_optimization": {"stage": 3, "overlap_comm": 0, "contiguous_gradients": 1}})
    assert cfg.zero_optimization.overlap_comm is False
    assert cfg.zero_optimization.contiguous_gradients is True


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (
            {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
            "fp16.enabled and bf16.enabled are both true",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            'zero_optimization.offload_param.nvme_path: required when device is "nvme"',
        ),
        (
            {
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}},
                "optimizer": {"type": "AdamW", "params": {}},
            },
            'zero_optimization.offload_optimizer.nvme_path: required when device is "nvme"',
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
            "zero_optimization.offload_optimizer.ratio: 0.5 is not allowed at stage 2; "
            "partial offload needs stage 3",
        ),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window: 0 is not allowed"),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale: 0 is not allowed"),
        (
            {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
            "bf16.bf16_master_weights_and_grads: true needs zero_optimization.stage 1, 2 or 3",
        ),
        (
            {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "bf16_optimizer_states": True}},
            "bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads: true",
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads: true needs zero_optimization.stage 1, 2 or 3",
        ),
        (
            {"zero_optimization": {"stage": 3}, "gradient_allreduce_op": "sum"},
            'gradient_allreduce_op: "sum" is not supported with ZeRO stage 3 (zero_optimization.stage 3)',
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
            "optimizer.params.max_grad_norm: not supported as an optimizer parameter",
        ),
        (
            {"scheduler": {"type": "WarmupLR", "params": {}}},
            "scheduler: a 'scheduler' block needs an optimizer",
        ),
        (
            {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}},
            'zero_optimization.offload_optimizer.device: "nvme" needs an optimizer',
        ),
    ],
)
def test_contradictory_settings(cfg: dict[str, Any], needle: str) -> None:
    assert needle in problem(cfg)


def test_settings_that_only_matter_elsewhere_are_fine() -> None:
    cfg, messages = load(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 128,
                "loss_scale_window": 0,
            },  # static scale: window unused
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}},
        }
    )
    assert cfg.fp16.loss_scale == 128.0
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.3
    assert messages == []
    summed, _ = load({"zero_optimization": {"stage": 2}, "gradient_allreduce_op": "sum"})
    assert summed.gradient_allreduce_op == "sum"


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        (
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
            "zero_optimization.offload_param has no effect at stage 2",
        ),
        (
            {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
            "zero_optimization.offload_optimizer has no effect at stage 0",
        ),
    ],
)
def test_ignored_settings_warn_once(cfg: dict[str, Any], needle: str) -> None:
    _, messages = load(cfg)
    assert len(messages) == 1 and needle in messages[0], messages
