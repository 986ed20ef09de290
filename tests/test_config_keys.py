"""Key policy: comments, typos with did-you-mean at every depth, ignored top-level keys, aliases."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from zeroshard.config import ConfigError, ConfigWarning, ZeroshardConfig, load_config

BATCH = {"train_batch_size": 8}


def load_with_warnings(cfg: dict[str, Any]) -> tuple[ZeroshardConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({**BATCH, **cfg}, world_size=2)
    return loaded, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def error_of(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({**BATCH, **cfg}, world_size=2)
    return str(info.value)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("train_batch_szie", "train_batch_size"),
        ("gradient_acumulation_steps", "gradient_accumulation_steps"),
        ("zero_optimisation", "zero_optimization"),
        ("fp_16", "fp16"),
        ("bf_16", "bf16"),
        ("optimiser", "optimizer"),
        ("schedular", "scheduler"),
        ("gradient_cliping", "gradient_clipping"),
        ("train_micro_batch_size", "train_micro_batch_size_per_gpu"),
        ("steps_per_prnt", "steps_per_print"),
    ],
)
def test_top_level_typos_are_errors_with_did_you_mean(typo: str, meant: str) -> None:
    assert f"{typo}: unknown key; did you mean '{meant}'?" in error_of({typo: 1})


@pytest.mark.parametrize(
    "key", ["cuda_visible_devices", "comms_config", "monitor_config", "local_rank", "fp32"]
)
def test_other_unknown_top_level_keys_warn_once_and_are_ignored(key: str) -> None:
    cfg, messages = load_with_warnings({key: {"enabled": True}})
    assert messages == [
        f"ds_config key '{key}' is not a DeepSpeed setting and is ignored (DeepSpeed ignores it too)"
    ]
    assert cfg.warnings == tuple(messages)


def test_comment_keys_are_ignored_at_any_depth() -> None:
    cfg, messages = load_with_warnings(
        {"_comment": "hi", "_notes": [1, 2], "zero_optimization": {"_why": "stage 2 fits", "stage": 2}}
    )
    assert messages == []
    assert cfg.zero_optimization.stage == 2


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (
            {"zero_optimization": {"reduce_bucket_szie": 1}},
            "zero_optimization.reduce_bucket_szie: unknown key; did you mean 'reduce_bucket_size'?",
        ),
        (
            {"zero_optimization": {"stage3_prefetch_bucket_szie": 1}},
            "did you mean 'stage3_prefetch_bucket_size'?",
        ),
        (
            {"zero_optimization": {"offload_param": {"devcie": "cpu"}}},
            "zero_optimization.offload_param.devcie: unknown key; did you mean 'device'?",
        ),
        (
            {"zero_optimization": {"offload_optimizer": {"pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy: unknown key; did you mean 'pin_memory'?",
        ),
        ({"zero_optimization": {"leaf_module": {"class": ["A"]}}}, "did you mean 'classes'?"),
        ({"fp16": {"loss_scael": 0}}, "fp16.loss_scael: unknown key; did you mean 'loss_scale'?"),
        ({"bf16": {"enable": True}}, "bf16.enable: unknown key; did you mean 'enabled'?"),
        ({"aio": {"queue_dept": 4}}, "aio.queue_dept: unknown key; did you mean 'queue_depth'?"),
        (
            {"checkpoint": {"writer": {"tpye": "fast"}}},
            "checkpoint.writer.tpye: unknown key; did you mean 'type'?",
        ),
        (
            {"optimizer": {"type": "Adam", "param": {}}},
            "optimizer.param: unknown key; did you mean 'params'?",
        ),
        (
            {"tensorboard": {"output_dir": "x"}},
            "tensorboard.output_dir: unknown key; did you mean 'output_path'?",
        ),
        ({"timers": {"throughput": {"enable": True}}}, "timers.throughput.enable: unknown key"),
        ({"zero_optimization": {"zenflow": {"topk_ration": 0.1}}}, "zero_optimization.zenflow.topk_ration"),
        (
            {"activation_checkpointing": {"partition_activation": True}},
            "did you mean 'partition_activations'?",
        ),
        (
            {"flops_profiler": {"enabeld": True}},
            "flops_profiler.enabeld: unknown key; did you mean 'enabled'?",
        ),
    ],
)
def test_unknown_nested_keys_are_errors_with_dotted_path(cfg: dict[str, Any], expected: str) -> None:
    assert expected in error_of(cfg)


def test_unknown_nested_key_without_close_match_lists_known_keys() -> None:
    message = error_of({"timers": {"latency": {}}})
    assert "timers.latency: unknown key; known keys: throughput" in message


def test_removed_compile_keys_are_rejected_like_deepspeed() -> None:
    message = error_of({"compile": {"disable": False, "backend": "inductor"}})
    assert "compile.disable: was removed" in message
    assert "compile.backend: was removed" in message


def test_opaque_blocks_are_not_key_checked() -> None:
    cfg, _ = load_with_warnings(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
            "amp": {"enabled": False, "opt_level": "O1", "nested": {"x": 2}},
        }
    )
    assert cfg.optimizer is not None and cfg.optimizer.params == {"lr": 1e-3, "betas": [0.8, 0.9]}
    assert cfg.amp == {"enabled": False, "opt_level": "O1", "nested": {"x": 2}}


def test_optimizer_and_scheduler_params_are_checked_by_their_constructors() -> None:
    """The params are keyword arguments: load_config checks them as initialize() builds them (both
    problems reported at once, naming the keys)."""
    with pytest.raises(ConfigError) as caught:
        load_with_warnings(
            {
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "nested": {"x": 2}}},
                "scheduler": {"type": "MySched", "params": {"whatever": True}},
            }
        )
    message = str(caught.value)
    assert "optimizer.params.nested: unknown key for torch.optim.AdamW" in message
    assert "scheduler.type: unknown scheduler 'MySched'" in message


STAGE3_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
}


@pytest.mark.parametrize(("alias", "field"), sorted(STAGE3_ALIASES.items()))
def test_stage3_keys_accept_both_spellings(alias: str, field: str) -> None:
    for key in (alias, field):
        cfg, _ = load_with_warnings({"zero_optimization": {"stage": 3, key: 12345}})
        assert getattr(cfg.zero_optimization, field) == 12345


@pytest.mark.parametrize(
    "key", ["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"]
)
def test_gather_16bit_accepts_both_spellings(key: str) -> None:
    cfg, messages = load_with_warnings({"zero_optimization": {"stage": 3, key: True}})
    assert cfg.zero_optimization.gather_16bit_weights_on_model_save is True
    assert messages == []


def test_tensor_parallel_aliases() -> None:
    cfg, _ = load_with_warnings({"tensor_parallel": {"tp": {"tp_size": 1}, "kernel_inject": False}})
    assert cfg.tensor_parallel["tensor_parallel"]["tp_size"] == 1


def test_one_setting_under_two_spellings_is_an_error() -> None:
    message = error_of({"zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}})
    assert (
        "zero_optimization.max_live_parameters: the same setting is also given as "
        "'stage3_max_live_parameters'" in message
    )


def test_world_size_and_warnings_are_not_config_keys() -> None:
    _, messages = load_with_warnings({"world_size": 8})
    assert messages == [
        "ds_config key 'world_size' is not a DeepSpeed setting and is ignored (DeepSpeed ignores it too)"
    ]
    assert "zero_optimization.world_size: unknown key" in error_of({"zero_optimization": {"world_size": 8}})


def test_null_block_means_defaults() -> None:
    cfg, _ = load_with_warnings({"zero_optimization": {"stage": 3, "offload_param": None}, "scheduler": None})
    assert cfg.zero_optimization.offload_param.device == "none"
    assert cfg.scheduler is None


# Every keyword DeepSpeed's own config models take (field, alias or deprecated spelling), read off the
# installed DeepSpeed by tools/deepspeed_inventory.py: a key DeepSpeed accepts is a key zeroshard knows.
_DEEPSPEED_BLOCKS = {
    "deepspeed.runtime.zero.config:DeepSpeedZeroConfig": "zero_optimization",
    "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadParamConfig": (
        "zero_optimization.offload_param"
    ),
    "deepspeed.runtime.zero.offload_config:DeepSpeedZeroOffloadOptimizerConfig": (
        "zero_optimization.offload_optimizer"
    ),
    "deepspeed.runtime.precision_config:DeepSpeedBF16Config": "bf16",
    "deepspeed.runtime.precision_config:DeepSpeedFP16Config": "fp16",
    "deepspeed.runtime.zero.leaf_module_config:DeepSpeedZeroLeafModuleConfig": (
        "zero_optimization.leaf_module"
    ),
    "deepspeed.runtime.zenflow.zenflow_config:ZenFlowConfig": "zero_optimization.zenflow",
    "deepspeed.comm.config:CommsLoggerConfig": "comms_logger",
    "deepspeed.monitor.config:CSVConfig": "csv_monitor",
    "deepspeed.monitor.config:CometConfig": "comet",
    "deepspeed.monitor.config:TensorBoardConfig": "tensorboard",
    "deepspeed.monitor.config:WandbConfig": "wandb",
    "deepspeed.utils.config:DeepSpeedThroughputTimerConfig": "timers.throughput",
    "deepspeed.runtime.config:HybridEngineConfig": "hybrid_engine",
    "deepspeed.runtime.tensor_parallel.config:TPTrainingConfig": "tensor_parallel",
}


def _nested(path: str, key: str, value: Any) -> dict[str, Any]:
    block: dict[str, Any] = {key: value}
    for part in reversed(path.split(".")):
        block = {part: block}
    return block


def test_every_key_deepspeeds_config_models_take_is_known() -> None:
    import ast
    import json
    from pathlib import Path

    inventory = json.loads((Path(__file__).parents[1] / "zeroshard/deepspeed/inventory.json").read_text())
    unknown = []
    for where, path in _DEEPSPEED_BLOCKS.items():
        module, name = where.split(":")
        params = inventory["modules"][module]["names"][name]["signature"]
        keys = [(key, default) for key, kind, default in params if kind == "KEYWORD_ONLY"]
        assert len(keys) >= 2, where
        for key, default in keys:
            try:
                value = ast.literal_eval(default.replace(",", "")) if default else None
            except (ValueError, SyntaxError):
                value = None
            config = _nested(path, key, value)
            if path.startswith("zero_optimization."):  # the offload blocks: at stage 3, where all apply
                config["zero_optimization"]["stage"] = 3
            try:
                load_with_warnings(config)
            except ConfigError as error:
                if "unknown key" in str(error):
                    unknown.append(f"{path}.{key}")
    assert not unknown, unknown


def test_compute_grad_norm_false_where_deepspeed_allows_it() -> None:
    loaded, _ = load_with_warnings(
        {"gradient_clipping": 0, "zero_optimization": {"stage": 2, "compute_grad_norm": False}}
    )
    assert loaded.zero_optimization.compute_grad_norm is False
    for extra, named in (
        ({"stage": 3}, "stage 3"),
        ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
    ):
        message = error_of(
            {"gradient_clipping": 0, "zero_optimization": {**extra, "compute_grad_norm": False}}
        )
        assert "zero_optimization.compute_grad_norm: false" in message and named in message, message
    message = error_of({"zero_optimization": {"stage": 2, "compute_grad_norm": False}})  # clipping 1.0
    assert "gradient_clipping 1" in message, message
    _, notes = load_with_warnings({"zero_optimization": {"stage": 2, "parameter_alignment": True}})
    assert any("parameter_alignment: true has no effect" in note for note in notes), notes


# Run by the real DeepSpeed (a subprocess without the alias): the top-level keys its DeepSpeedConfig reads.
_DEEPSPEED_TOP_LEVEL_READS = """
import json
from deepspeed.runtime.config import DeepSpeedConfig
seen = set()
class Spy(dict):
    def get(self, key, default=None):
        seen.add(key)
        return super().get(key, default)
    def __getitem__(self, key):
        seen.add(key)
        return super().__getitem__(key)
    def __contains__(self, key):
        seen.add(key)
        return super().__contains__(key)
DeepSpeedConfig(Spy({"train_batch_size": 8}))
print(json.dumps(sorted(k for k in seen if isinstance(k, str))))
"""


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_top_level_key_deepspeed_reads_is_known() -> None:
    """A key DeepSpeed 0.19.8's config reads is one zeroshard knows (not warned about as "not a DeepSpeed
    setting"): its own field or alias, a feature block, or a deprecated spelling it rewrites."""
    import json
    import os
    import subprocess
    import sys

    from zeroshard.config.keys import top_level_keys

    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_AS_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED_TOP_LEVEL_READS],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"zero_optimization", "bf16", "disable_python_gc"} <= set(read), read  # the spy sees the reads
    known = set(top_level_keys(ZeroshardConfig)) | {"bfloat16"}  # bfloat16: deprecated.py rewrites it
    assert [key for key in read if key not in known] == []
