"""The `zero_optimization` block: ZeRO stage, buckets, stage-3 prefetching and offload.

Defaults are DeepSpeed 0.19.6's (`deepspeed/runtime/zero/config.py`, `offload_config.py`,
`leaf_module_config.py`, `zenflow/zenflow_config.py`). `docs/config.md` lists them all.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from zeroshard.config.base import Block, Bool, Float, Int, IntOrAuto, OptInt, OptStr, StrList, coerce_int

__all__ = [
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ZenFlowConfig",
    "ZeroConfig",
]

Stage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(coerce_int)]
Device = Literal["none", "cpu", "nvme"]

_DEFAULT_LEAF_CLASSES = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)


class OffloadParamConfig(Block):
    """`zero_optimization.offload_param`: where stage-3 parameter shards live between uses."""

    device: Device = "none"
    """"none" keeps parameters on the accelerator; "cpu" or "nvme" offloads them."""
    nvme_path: OptStr = None
    """Directory for NVMe offload; required when `device` is "nvme"."""
    buffer_count: Annotated[Int, Field(ge=0)] = 5
    """Buffers in the NVMe swap pool."""
    buffer_size: Annotated[Int, Field(ge=0)] = 100_000_000
    """Elements per NVMe swap buffer."""
    max_in_cpu: Annotated[Int, Field(ge=0)] = 1_000_000_000
    """Parameter elements kept in CPU memory when offloading to NVMe."""
    pin_memory: Bool = True
    """Use page-locked CPU memory for offloaded tensors."""


class OffloadOptimizerConfig(Block):
    """`zero_optimization.offload_optimizer`: where optimizer state lives and the step runs."""

    device: Device = "none"
    """"none" keeps optimizer state on the accelerator; "cpu" or "nvme" offloads it."""
    nvme_path: OptStr = None
    """Directory for NVMe offload; required when `device` is "nvme"."""
    buffer_count: Annotated[Int, Field(ge=0)] = 4
    """Buffers in the NVMe swap pool (at least the number of states per parameter)."""
    pin_memory: Bool = True
    """Use page-locked CPU memory for offloaded tensors."""
    pipeline_read: Bool = False
    """Overlap reading the next tile with the step on the current one (NVMe)."""
    pipeline_write: Bool = False
    """Overlap writing the previous tile with the step on the current one (NVMe)."""
    fast_init: Bool = False
    """Fast optimizer initialisation when offloading to NVMe."""
    ratio: Annotated[Float, Field(ge=0.0, le=1.0)] = 1.0
    """Fraction of optimizer state offloaded; below 1.0 only at stage 3."""
    super_offload: Bool = False
    """DeepSpeed's SuperOffload for superchips (no effect in zeroshard)."""
    cpuadam_cores_perc: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.8
    """Share of CPU cores for SuperOffload's CPU Adam (no effect in zeroshard)."""


class LeafModuleConfig(Block):
    """`zero_optimization.leaf_module`: modules whose parameters stage 3 gathers as one unit."""

    classes: StrList = Field(default_factory=lambda: list(_DEFAULT_LEAF_CLASSES))
    """Fully qualified class names."""
    names: StrList = Field(default_factory=list)
    """Module names as in `named_modules()`."""
    name_suffixes: StrList = Field(default_factory=list)
    """Suffixes of module names."""


class ZenFlowConfig(Block):
    """`zero_optimization.zenflow`: DeepSpeed's ZenFlow (no effect in zeroshard; typed to validate)."""

    topk_ratio: Annotated[Float, Field(gt=0.0, lt=1.0)] = 0.1
    """Share of gradient columns treated as important."""
    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """How important columns are reselected."""
    select_interval: IntOrAuto = "auto"
    """Reselection interval."""
    update_interval: IntOrAuto = "auto"
    """Interval for applying the unimportant gradients."""
    overlap_step: Bool = False
    """Overlap the CPU step with forward/backward."""
    offload: Bool = False
    """Offload selective optimizer state."""
    auto_ratio: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.99
    """Threshold of the "auto" strategy."""
    full_warm_up_rounds: Int = 0
    """Rounds at the start that update every column."""
    pt_reserved_cores_perc: Annotated[Float, Field(ge=0.0, le=1.0)] = 0.5
    """Share of cores reserved for PyTorch threads."""
    steps_per_epoch: OptInt = None
    """Set by DeepSpeed at run time."""


class ZeroConfig(Block):
    """`zero_optimization`: what is sharded (the stage) and how it is communicated.

    Invariant: `overlap_comm` is resolved (DeepSpeed's `None` means True at stage 3, False below).
    """

    input_aliases: ClassVar[dict[str, str]] = {
        "stage3_prefetch_bucket_size": "prefetch_bucket_size",
        "stage3_param_persistence_threshold": "param_persistence_threshold",
        "stage3_model_persistence_threshold": "model_persistence_threshold",
        "stage3_max_live_parameters": "max_live_parameters",
        "stage3_max_reuse_distance": "max_reuse_distance",
        "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
        "stage3_module_granularity_threshold": "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential": "allgather_sequential",
    }

    stage: Stage = 0
    """0 = plain data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters."""
    contiguous_gradients: Bool = True
    """Copy gradients into a contiguous buffer as they are produced."""
    reduce_scatter: Bool = True
    """Reduce gradients with reduce-scatter instead of all-reduce."""
    reduce_bucket_size: Annotated[Int, Field(gt=0)] = 500_000_000
    """Elements reduced at a time (at most: stage 0-2 units also stop at 2**22 elements, see
    ``core/units.py`` [Note: bounded units])."""
    use_multi_rank_bucket_allreduce: Bool = True
    """DeepSpeed's combined all-reduce of several ranks' buckets."""
    allgather_partitions: Bool = True
    """All-gather updated partitions (instead of broadcasts) after the step."""
    allgather_bucket_size: Annotated[Int, Field(ge=0)] = 500_000_000
    """Elements all-gathered at a time."""
    overlap_comm: Bool = False
    """Overlap gradient reduction with backward (resolved, see the class docstring)."""
    load_from_fp32_weights: Bool = True
    """Restore fp32 master weights from the checkpoint's fp32 copy."""
    elastic_checkpoint: Bool = False
    """Legacy elastic checkpointing."""
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3); device "none" when the block is absent."""
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload; device "none" when the block is absent."""
    zenflow: ZenFlowConfig | None = None
    """ZenFlow settings, None when absent."""
    sub_group_size: Annotated[Int, Field(ge=0)] = 1_000_000_000
    """Elements per optimizer sub-group (tile) at stage 3."""
    prefetch_bucket_size: Annotated[Int, Field(ge=0)] = 50_000_000
    """Stage 3: parameter elements fetched ahead of use (alias stage3_prefetch_bucket_size)."""
    param_persistence_threshold: Annotated[Int, Field(ge=0)] = 100_000
    """Stage 3: parameters smaller than this stay unsharded."""
    model_persistence_threshold: Annotated[Int, Field(ge=0)] = sys.maxsize
    """Stage 3: cap on the total elements kept unsharded."""
    max_live_parameters: Annotated[Int, Field(ge=0)] = 1_000_000_000
    """Stage 3: parameter elements resident before releasing."""
    max_reuse_distance: Annotated[Int, Field(ge=0)] = 1_000_000_000
    """Stage 3: keep a parameter if it is reused within this many elements."""
    gather_16bit_weights_on_model_save: Bool = False
    """Stage 3: accepted, no effect: save_16bit_model always streams full weights at stage 3."""
    module_granularity_threshold: Int = 0
    """Stage 3: modules whose parameters per layer are at most this are gathered whole (leaves)."""
    use_all_reduce_for_fetch_params: Bool = False
    """Stage 3: DeepSpeed fetches parameters with all-reduce."""
    allgather_sequential: Bool = False
    """Stage 3: DeepSpeed all-gathers parameters one by one."""
    ignore_unused_parameters: Bool = True
    """Tolerate parameters that get no gradient."""
    legacy_stage1: Bool = False
    """DeepSpeed's old stage-1 implementation."""
    round_robin_gradients: Bool = False
    """Stage 1/2 with CPU offload: split gradient copies among ranks."""
    zero_hpz_partition_size: Annotated[Int, Field(ge=0)] = 1
    """ZeRO++ hierarchical partitioning group size (1 = off)."""
    zero_quantized_weights: Bool = False
    """ZeRO++ quantized weight all-gather."""
    zero_quantized_nontrainable_weights: Bool = False
    """ZeRO++ quantized storage of frozen weights."""
    zero_quantized_gradients: Bool = False
    """ZeRO++ quantized gradient reduction."""
    zeropp_loco_param: dict[str, Any] | None = None
    """ZeRO++ LoCo settings, kept as given."""
    mics_shard_size: Int = -1
    """MiCS shard group size (-1 = off)."""
    mics_hierarchical_params_gather: Bool = False
    """MiCS hierarchical all-gather."""
    memory_efficient_linear: Bool = True
    """Stage 3: DeepSpeed's memory-efficient linear layer."""
    pipeline_loading_checkpoint: Bool = False
    """Stage 3: force pipeline-mode checkpoint loading."""
    override_module_apply: Bool = True
    """Stage 3: DeepSpeed overrides nn.Module.apply."""
    log_trace_cache_warnings: Bool = False
    """Stage 3: log trace-cache invalidations."""
    enable_sanity_checks: Bool = False
    """Internal sanity checks."""
    save_muon_momentum_buffer_in_memory: Bool = False
    """Keep Muon's momentum in memory with NVMe offload."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Modules gathered as one unit at stage 3."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_overlap_comm(cls, data: Any) -> Any:
        # DeepSpeed's default is None, meaning "on for stage 3 only"; store the resolved value.
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            data = {**data, "overlap_comm": data.get("stage", 0) == 3}
        return data
