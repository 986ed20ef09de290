"""load_config basics: sources, defaults (DeepSpeed 0.19.6's), the frozen result and its dump."""

from __future__ import annotations

import base64
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pydantic
import pytest

from zeroshard.config import ConfigError, ConfigTypeError, ConfigWarning, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}


def load(cfg: Any, world_size: int = 2, **kwargs: Any) -> ZeroshardConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # these tests expect no warnings
        return load_config(cfg, world_size=world_size, **kwargs)


def test_defaults_are_deepspeed_0_19_6s() -> None:
    cfg = load(BATCH)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        8,
        4,
        1,
    )
    assert cfg.world_size == 2
    assert cfg.steps_per_print is None
    assert cfg.gradient_clipping == 1.0
    assert (cfg.wall_clock_breakdown, cfg.memory_breakdown, cfg.dataloader_drop_last) == (False, False, False)
    assert (cfg.prescale_gradients, cfg.gradient_predivide_factor, cfg.sparse_gradients) == (
        False,
        1.0,
        False,
    )
    assert cfg.communication_data_type is None
    assert (cfg.zero_allow_untested_optimizer, cfg.zero_force_ds_cpu_optimizer) == (False, True)
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.data_types.grad_accum_dtype is None
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False
    assert (zero.contiguous_gradients, zero.reduce_scatter, zero.allgather_partitions) == (True, True, True)
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold) == (50_000_000, 100_000)
    assert zero.model_persistence_threshold == sys.maxsize
    assert (zero.max_live_parameters, zero.max_reuse_distance) == (1_000_000_000, 1_000_000_000)
    assert (zero.sub_group_size, zero.gather_16bit_weights_on_model_save) == (1_000_000_000, False)
    assert (zero.load_from_fp32_weights, zero.elastic_checkpoint) == (True, False)
    assert (zero.round_robin_gradients, zero.ignore_unused_parameters, zero.mics_shard_size) == (
        False,
        True,
        -1,
    )
    assert zero.leaf_module.names == [] and len(zero.leaf_module.classes) == 3
    assert zero.offload_param.device == "none" and zero.offload_optimizer.device == "none"
    assert (zero.offload_param.buffer_count, zero.offload_param.buffer_size) == (5, 100_000_000)
    assert (zero.offload_param.max_in_cpu, zero.offload_param.pin_memory) == (1_000_000_000, True)
    assert (zero.offload_optimizer.buffer_count, zero.offload_optimizer.pin_memory) == (4, True)
    assert (zero.offload_optimizer.ratio, zero.offload_optimizer.fast_init) == (1.0, False)
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (
        False,
        False,
        0.0,
        16,
    )
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    assert (fp16.consecutive_hysteresis, fp16.fp16_master_weights_and_grads) == (False, False)
    bf16 = cfg.bf16
    assert (bf16.enabled, bf16.immediate_grad_update, bf16.check_grad_overflow) == (False, False, True)
    assert (cfg.aio.block_size, cfg.aio.queue_depth, cfg.aio.intra_op_parallelism) == (1_048_576, 8, 1)
    assert (cfg.aio.single_submit, cfg.aio.overlap_events, cfg.aio.use_gds) == (False, True, False)
    assert cfg.checkpoint.tag_validation == "WARN" and cfg.checkpoint.writer is None
    assert cfg.tensorboard.enabled is False and cfg.wandb.project == "deepspeed"
    assert cfg.activation_checkpointing["partition_activations"] is False
    assert cfg.warnings == ()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overlap_comm_default_depends_on_stage(stage: int) -> None:
    cfg = load({**BATCH, "zero_optimization": {"stage": stage}})
    assert cfg.zero_optimization.overlap_comm is (stage == 3)
    explicit = load({**BATCH, "zero_optimization": {"stage": stage, "overlap_comm": stage != 3}})
    assert explicit.zero_optimization.overlap_comm is (stage != 3)


def test_whole_floats_are_accepted_for_integers() -> None:
    cfg = load(
        {"train_batch_size": 8.0, "zero_optimization": {"reduce_bucket_size": 5e8, "sub_group_size": 1e14}}
    )
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.sub_group_size == 10**14
    assert isinstance(cfg.zero_optimization.sub_group_size, int)
    assert cfg.train_batch_size == 8 and isinstance(cfg.train_batch_size, int)


def test_result_is_frozen() -> None:
    cfg = load(BATCH)
    with pytest.raises(pydantic.ValidationError):
        cfg.train_batch_size = 16  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        cfg.zero_optimization.stage = 3  # type: ignore[misc]


def test_to_dict_and_dump_are_json() -> None:
    cfg = load({**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}})
    as_dict = cfg.to_dict()
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["zero_optimization"]["offload_param"]["device"] == "none"
    assert as_dict["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 1e-3, "betas": [0.9, 0.99]},
        "legacy_fusion": False,
    }
    assert "warnings" not in as_dict
    assert json.loads(cfg.dump()) == as_dict


def test_input_dict_is_not_modified() -> None:
    raw = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 2,
        "bfloat16": {"enabled": True},
        "zero_optimization": {"cpu_offload": True},
    }
    snapshot = json.loads(json.dumps(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_config(raw, world_size=2)
    assert raw == snapshot


def test_path_sources(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**BATCH, "zero_optimization": {"stage": 2}}))
    for source in (path, str(path)):
        assert load(source).zero_optimization.stage == 2


def test_base64_source_like_deepspeeds_launcher() -> None:
    encoded = base64.urlsafe_b64encode(json.dumps(BATCH).encode()).decode()
    assert load(encoded).train_batch_size == 8


def test_invalid_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true]\n}\n')  # not Hjson either
    with pytest.raises(ValueError, match=r"broken\.json.*line 3, column 27"):
        load_config(path, world_size=1)


def test_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match="'train_batch_size' appears twice"):
        load_config(path, world_size=1)


def test_missing_file_and_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config file not found"):
        load_config(tmp_path / "nope.json", world_size=1)
    with pytest.raises(TypeError, match="dict or the path"):
        load_config(42, world_size=1)  # type: ignore[arg-type]
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="top level must be a JSON object"):
        load_config(path, world_size=1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size"),
        ({"world_size": True}, ValueError, "world_size"),
        ({"world_size": 2, "hidden_size": 0}, ValueError, "hidden_size"),
        ({"world_size": 2, "model_dtype": "bf16"}, TypeError, "model_dtype"),
        ({"world_size": 2, "client_optimizer": object()}, TypeError, "client_optimizer"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_config(BATCH, **kwargs)


def test_all_problems_are_reported_together() -> None:
    cfg = {
        "train_batch_size": 0,
        "zero_optimization": {"stage": 7, "reduce_bucket_szie": 1},
        "fp16": {"enabled": 2},
    }
    with pytest.raises(ConfigError) as info:
        load_config(cfg, world_size=2)
    message = str(info.value)
    assert "4 problems" in message
    for needle in ("train_batch_size", "zero_optimization.stage", "reduce_bucket_szie", "fp16.enabled"):
        assert needle in message
    assert isinstance(info.value, ConfigTypeError)  # fp16.enabled 2 is a type error
    assert "pydantic" not in message and "validation error" not in message


def test_dict_keys_must_be_strings() -> None:
    with pytest.raises(ConfigTypeError, match=r"zero_optimization\.3: keys must be strings"):
        load_config({**BATCH, "zero_optimization": {3: "stage"}}, world_size=2)
    with pytest.raises(ConfigTypeError, match="1: keys must be strings"):
        load_config({**BATCH, 1: 2}, world_size=2)
