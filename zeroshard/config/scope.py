"""When a config turns on a DeepSpeed feature zeroshard does not implement (`OUT_OF_SCOPE`, read by
`out_of_scope_warnings`), and the in-scope settings whose non-default value zeroshard does not act
on (`NO_EFFECT`). The feature blocks themselves are declared in `features.py` ([Note: features as data]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["NO_EFFECT", "OUT_OF_SCOPE", "Feature"]


@dataclass(frozen=True)
class Feature:
    """When a config turns on a DeepSpeed feature zeroshard does not implement.

    Attributes:
        name: The feature, as the warning names it.
        at: Dotted location of its settings in the config ("" for the top level).
        on: "enabled" (the block's `enabled` is true), "changed" (a setting differs from DeepSpeed's
            default), "present" (the block is given and neither false nor `enabled: false`), or
            "custom" (`checks.py` has a rule for it).
        settings: For "changed", only these settings count (default: all of the block's).
        defaults: For "changed" on a block kept as given, DeepSpeed's defaults (other keys count as
            changed).
    """

    name: str
    at: str
    on: Literal["enabled", "changed", "present", "custom"]
    settings: tuple[str, ...] = ()
    defaults: Mapping[str, Any] | None = None


# zero_quantized_weights / zero_quantized_gradients and zero_hpz_partition_size are implemented.
_ZERO_PLUS_PLUS = ("zero_quantized_nontrainable_weights", "zeropp_loco_param")
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
_PIPELINE_DEFAULTS = {
    "stages": "auto",
    "partition": "best",
    "seed_layers": False,
    "activation_checkpoint_interval": 0,
    "pipe_partitioned": True,
    "grad_partitioned": True,
}

OUT_OF_SCOPE: tuple[Feature, ...] = (
    Feature("pipeline parallelism", "pipeline", "changed", defaults=_PIPELINE_DEFAULTS),
    Feature("tensor parallelism (AutoTP)", "tensor_parallel", "changed"),
    Feature("the FLOPs profiler", "flops_profiler", "enabled"),
    Feature("ZeRO++", "zero_optimization", "changed", _ZERO_PLUS_PLUS),
    Feature("ZenFlow", "zero_optimization.zenflow", "present"),
    Feature("SuperOffload", "zero_optimization.offload_optimizer", "changed", ("super_offload",)),
    Feature("DeepSpeed-internal ZeRO switches", "zero_optimization", "changed", _ZERO_INTERNALS),
    Feature("sparse attention", "sparse_attention", "present"),
    Feature("compression training", "compression_training", "custom"),
    Feature("quantize-aware training (MoQ)", "quantize_training", "enabled"),
    Feature("inference weight quantization", "weight_quantization", "present"),
    Feature("DeepSpeed activation checkpointing", "activation_checkpointing", "changed"),
    Feature("eigenvalue computation", "eigenvalue", "enabled"),
    Feature("progressive layer drop", "progressive_layer_drop", "enabled"),
    Feature("curriculum learning", "curriculum_learning", "enabled"),
    Feature("the data efficiency library", "data_efficiency", "enabled"),
    Feature("the autotuner", "autotuning", "enabled"),
    Feature("Apex AMP", "amp", "enabled"),
    Feature("torch.autocast", "torch_autocast", "enabled"),
    Feature("DeepSpeed compile", "compile", "changed"),
    Feature("sequence parallelism", "", "custom"),
    Feature("expert parallelism (AutoEP)", "expert_parallel", "enabled"),
    Feature("the hybrid engine", "hybrid_engine", "enabled"),
    Feature("Nebula checkpointing", "nebula", "enabled"),
    Feature("DataStates checkpointing", "datastates_ckpt", "present"),
    Feature("the Comet monitor", "comet", "enabled"),
    Feature("DeepSpeed engine switches", "", "changed", _ENGINE_SWITCHES),
)
"""Every DeepSpeed feature zeroshard does not implement, and when a config turns it on; one warning per
feature turned on names its settings (see [Note: out-of-scope features] in scope_warnings.py)."""

_FP32_STATE = (
    "zeroshard keeps the master weights, the gradients they are stepped with and the optimizer state in fp32"
)

NO_EFFECT: tuple[tuple[str, Any, str], ...] = (
    (
        "gradient_allreduce_op",
        "sum",
        'zeroshard always averages gradients over the data-parallel ranks, as "mean" (the default) does',
    ),
    ("sparse_gradients", True, "zeroshard reduces every gradient as a dense tensor"),
    (
        "zero_optimization.parameter_alignment",
        True,
        "zeroshard lays out its flat units its own way, which changes no value",
    ),
    (
        "zero_optimization.mics_hierarchical_params_gather",
        True,
        "hybrid sharding (mics_shard_size) gathers parameters with one all-gather over the shard group, not "
        "node by node; the results are the same",
    ),
    ("fp16.fp16_master_weights_and_grads", True, _FP32_STATE),
    ("bf16.bf16_master_weights_and_grads", True, _FP32_STATE),
    ("bf16.bf16_optimizer_states", True, _FP32_STATE),
    (
        "zero_optimization.ignore_unused_parameters",
        False,
        "zeroshard does not check that every trained parameter got a gradient: the step skips a parameter "
        "no rank produced one for, as torch's optimizers do",
    ),
    (
        "memory_breakdown",
        True,
        "zeroshard does not log allocator memory; the steps_per_print line and engine.memory_breakdown() "
        "report this rank's parameter, gradient, optimizer-state and buffer bytes",
    ),
)
"""In-scope settings zeroshard does not act on: (dotted key, the value that warns, what zeroshard does
instead). See [Note: settings without effect] in checks.py."""
