"""Resolving "auto" from what initialize() knows, and clear errors where nothing can resolve it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from zeroshard.config import ConfigError, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


def load(cfg: dict[str, Any], **kwargs: Any) -> ZeroshardConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config({**BATCH, **cfg}, world_size=2, **kwargs)


def error_of(cfg: dict[str, Any], **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, **cfg}, world_size=2, **kwargs)
    return str(info.value)


AUTO_OPTIMIZER = {
    "type": "AdamW",
    "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
}


def test_optimizer_params_come_from_the_client_optimizer() -> None:
    client = torch.optim.AdamW(params(), lr=3e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    cfg = load({"optimizer": AUTO_OPTIMIZER}, client_optimizer=client)
    assert cfg.optimizer is not None
    assert cfg.optimizer.params == {"lr": 3e-3, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}
    assert cfg.optimizer.type == "AdamW"


def test_tensor_learning_rate_is_read_as_a_number() -> None:
    client = torch.optim.Adam(params(), lr=torch.tensor(0.02))
    cfg = load({"optimizer": {"type": "Adam", "params": {"lr": "auto"}}}, client_optimizer=client)
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == pytest.approx(0.02)


def test_optimizer_auto_without_client_optimizer_is_an_error() -> None:
    message = error_of({"optimizer": AUTO_OPTIMIZER})
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert (
            f'optimizer.params.{key}: "auto" is copied from the client optimizer, but none was given'
            in message
        )


def test_optimizer_auto_missing_from_client_defaults_is_an_error() -> None:
    message = error_of(
        {"optimizer": {"type": "SGD", "params": {"betas": "auto"}}},
        client_optimizer=torch.optim.SGD(params(), lr=0.1),
    )
    assert (
        "optimizer.params.betas: \"auto\" cannot be resolved: the client optimizer SGD has no default 'betas'"
        in message
    )


def test_optimizer_and_scheduler_type_auto_is_an_error() -> None:
    message = error_of({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto"}})
    assert 'optimizer.type: "auto" cannot be resolved' in message
    assert 'scheduler.type: "auto" cannot be resolved' in message


def test_scheduler_lrs_follow_the_optimizer() -> None:
    scheduler = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 10},
    }
    from_config = load({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "scheduler": scheduler})
    assert from_config.scheduler is not None
    assert from_config.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 5e-4, "warmup_num_steps": 10}
    from_client = load({"scheduler": scheduler}, client_optimizer=torch.optim.SGD(params(), lr=0.25))
    assert from_client.scheduler is not None and from_client.scheduler.params["warmup_max_lr"] == 0.25
    resolved_auto = load(
        {"optimizer": AUTO_OPTIMIZER, "scheduler": scheduler},
        client_optimizer=torch.optim.AdamW(params(), lr=7e-4),
    )
    assert resolved_auto.scheduler is not None and resolved_auto.scheduler.params["warmup_max_lr"] == 7e-4


def test_scheduler_autos_that_nothing_can_resolve() -> None:
    scheduler = {
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": "auto", "warmup_num_steps": "auto", "warmup_max_lr": "auto"},
    }
    message = error_of({"scheduler": scheduler})
    assert (
        'scheduler.params.total_num_steps: "auto" cannot be resolved: only the training script knows it'
        in message
    )
    assert 'scheduler.params.warmup_num_steps: "auto" cannot be resolved' in message
    assert 'scheduler.params.warmup_max_lr: "auto" takes the optimizer\'s lr, but there is none' in message


ZERO_AUTO = {
    "stage": 3,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
}


def test_bucket_sizes_from_hidden_size() -> None:
    zero = load({"zero_optimization": ZERO_AUTO}, hidden_size=1024).zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.prefetch_bucket_size == int(0.9 * 1024 * 1024) == 943_718
    assert zero.param_persistence_threshold == 10 * 1024


def test_bucket_sizes_without_hidden_size_take_deepspeeds_defaults() -> None:
    zero = load({"zero_optimization": ZERO_AUTO}).zero_optimization
    assert (zero.reduce_bucket_size, zero.prefetch_bucket_size, zero.param_persistence_threshold) == (
        500_000_000,
        50_000_000,
        100_000,
    )


def test_other_autos_in_typed_blocks_take_the_field_default() -> None:
    cfg = load(
        {
            "zero_optimization": {
                "stage": 3,
                "overlap_comm": "auto",
                "stage3_max_live_parameters": "auto",
                "stage3_gather_16bit_weights_on_model_save": "auto",
                "offload_param": {"device": "cpu", "buffer_size": "auto"},
            },
            "fp16": {"enabled": False, "initial_scale_power": "auto"},
            "gradient_clipping": "auto",
            "steps_per_print": "auto",
            "wall_clock_breakdown": "auto",
        }
    )
    zero = cfg.zero_optimization
    assert zero.overlap_comm is True and zero.max_live_parameters == 1_000_000_000
    assert zero.gather_16bit_weights_on_model_save is False and zero.offload_param.buffer_size == 100_000_000
    assert cfg.fp16.initial_scale_power == 16
    assert cfg.gradient_clipping == 1.0  # DeepSpeed 0.19.6's default
    assert cfg.steps_per_print is None and cfg.wall_clock_breakdown is False


def test_opaque_blocks_keep_auto() -> None:
    cfg = load({"pipeline": {"stages": "auto"}})
    assert cfg.pipeline == {"stages": "auto"}


@pytest.mark.parametrize(
    ("dtype", "fp16", "bf16"),
    [
        (torch.float16, True, False),
        (torch.bfloat16, False, True),
        (torch.float32, False, False),
        (None, False, False),
    ],
)
def test_precision_enabled_auto_follows_the_model_dtype(
    dtype: torch.dtype | None, fp16: bool, bf16: bool
) -> None:
    cfg = load({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}, model_dtype=dtype)
    assert (cfg.fp16.enabled, cfg.bf16.enabled) == (fp16, bf16)


def test_legacy_bfloat16_auto() -> None:
    cfg = load({"bfloat16": {"enabled": "auto"}}, model_dtype=torch.bfloat16)
    assert cfg.bf16.enabled is True
