"""The typed blocks of a ds_config that zeroshard reads: ZeRO, precision, optimizer and
scheduler; aio, checkpoint, monitors and timers are in `run_blocks.py` (re-exported here).

Defaults are DeepSpeed 0.19.6's (`deepspeed/runtime/zero/config.py`, `offload_config.py`,
`leaf_module_config.py`, `zenflow/zenflow_config.py`, `runtime/precision_config.py`,
`runtime/constants.py`, `runtime/swap_tensor/constants.py`, `runtime/model_checkpointing/`,
`monitor/config.py`, `comm/config.py`, `utils/config.py`); `docs/config.md` lists them all. Blocks of
features zeroshard does not implement are declared as data in `features.py`.

[Note: input aliases] DeepSpeed accepts two spellings for some keys (`stage3_prefetch_bucket_size` and
`prefetch_bucket_size`). Our models have one field per setting, named like DeepSpeed's field; the other
spellings live in the class's `input_aliases` and are renamed before validation (see `keys.py`), so error
locations always use field names and a key given under both spellings is caught.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from zeroshard.config.run_blocks import (
    AioConfig,
    CheckpointConfig,
    CheckpointWriterConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    ParallelWriteConfig,
    TensorBoardConfig,
    ThroughputTimerConfig,
    TimersConfig,
    WandbConfig,
)
from zeroshard.config.values import (
    INT_MAX,
    Block,
    Bool,
    DtypeName,
    Float,
    Int,
    IntOrAuto,
    OptBool,
    OptInt,
    OptStr,
    OptStrList,
    Str,
    StrList,
    coerce_int,
    normalize_dtype,
    upper,
)

__all__ = [
    "INT_MAX",
    "AioConfig",
    "BF16Config",
    "Block",
    "Bool",
    "CSVConfig",
    "CheckpointConfig",
    "CheckpointWriterConfig",
    "CometConfig",
    "CommsLoggerConfig",
    "DataTypesConfig",
    "DtypeName",
    "FP16Config",
    "Float",
    "Int",
    "IntOrAuto",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptBool",
    "OptInt",
    "OptStr",
    "OptStrList",
    "OptimizerSpec",
    "ParallelWriteConfig",
    "SchedulerSpec",
    "Str",
    "StrList",
    "TensorBoardConfig",
    "ThroughputTimerConfig",
    "TimersConfig",
    "WandbConfig",
    "ZenFlowConfig",
    "ZeroConfig",
    "coerce_int",
    "normalize_dtype",
    "upper",
]


class FP16Config(Block):
    """`fp16`: float16 mixed precision with a dynamic (or static) loss scale."""

    enabled: Bool = False
    """Train with fp16 compute and fp32 master weights."""
    auto_cast: Bool = False
    """Cast floating-point inputs to fp16."""
    loss_scale: Annotated[Float, Field(ge=0.0)] = 0.0
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: Annotated[Int, Field(ge=0, le=127)] = 16
    """Dynamic scaling starts at 2**initial_scale_power (0 to 127: the scale must be finite in fp32)."""
    loss_scale_window: Int = 1000
    """Overflow-free steps before the scale is raised."""
    hysteresis: Int = 2
    """Overflows tolerated before the scale is lowered."""
    consecutive_hysteresis: Bool = False
    """Refill hysteresis after every overflow-free step."""
    min_loss_scale: Float = 1.0
    """Lower bound of the dynamic scale."""
    fp16_master_weights_and_grads: Bool = False
    """Keep master weights and gradients in fp16 (DeepSpeed: with its CPU Adam only); zeroshard keeps
    them in fp32 and warns when this is true."""


class BF16Config(Block):
    """`bf16` (legacy spelling `bfloat16`): bfloat16 mixed precision, no loss scaling."""

    enabled: Bool = False
    """Train with bf16 compute."""
    immediate_grad_update: Bool = False
    """Accumulate each gradient into the fp32 buffer as soon as autograd produces it. zeroshard always
    does (see [Note: settings without effect] in checks.py); `false` changes no value."""
    check_grad_overflow: Bool = True
    """Skip the step when gradients overflow (on by default in DeepSpeed 0.19.6)."""
    bf16_master_weights_and_grads: Bool = False
    """Keep master weights and gradients in bf16 (stages 1-3); zeroshard keeps them in fp32 and warns
    when this is true."""
    bf16_optimizer_states: Bool = False
    """Keep optimizer state in bf16 (needs bf16_master_weights_and_grads); zeroshard keeps it in fp32
    and warns when this is true."""


class DataTypesConfig(Block):
    """`data_types`: dtype overrides; None means "follow the precision mode"."""

    grad_accum_dtype: DtypeName = None
    """Dtype the kept gradients are accumulated in; None: fp32 with gradient accumulation, else the
    compute dtype."""
    param_dtype: DtypeName = None
    """Dtype of the parameters; must be the precision mode's (fp16, bf16 or fp32) when given."""
    buffer_dtype: DtypeName = None
    """Dtype buffers are cast to. zeroshard casts floating-point buffers to the compute dtype under
    fp16/bf16 and leaves them in fp32 training; it warns when this asks for another dtype."""


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
    compute_grad_norm: Bool = True
    """Stages 1-2 (DeepSpeed 0.19.8): false stops DeepSpeed computing the global gradient norm, and needs
    gradient_clipping 0 and no optimizer offload; ``get_global_grad_norm()`` then returns None. zeroshard
    still sums the norm's pieces to skip a step whose gradients are not finite."""
    parameter_alignment: Bool = False
    """Stages 1-2 (DeepSpeed 0.19.8): pad each parameter to 16 bytes in the flat buffers; no effect (the
    layout of zeroshard's units changes no value)."""
    legacy_stage1: Bool = False
    """DeepSpeed's old stage-1 implementation."""
    round_robin_gradients: Bool = False
    """Stage 1/2 with CPU offload: split gradient copies among ranks."""
    zero_hpz_partition_size: Annotated[Int, Field(ge=0)] = 1
    """ZeRO++ hierarchical partitioning (hpZ, stage 3): the backward gathers parameters from secondary
    shards over groups of this many consecutive ranks; must divide the world size (0, 1, >= world: off)."""
    zero_quantized_weights: Bool = False
    """ZeRO++ qwZ (stage 3): parameters all-gathered in blockwise int8, 1/2 (bf16) or 1/4 (fp32) of the
    bytes; lossy."""
    zero_quantized_nontrainable_weights: Bool = False
    """ZeRO++ quantized storage of frozen weights."""
    zero_quantized_gradients: Bool = False
    """ZeRO++ qgZ (stage 3): gradients reduce-scattered as blockwise int8 chunks (an all-to-all); lossy."""
    zeropp_loco_param: dict[str, Any] | None = None
    """ZeRO++ LoCo settings, kept as given."""
    mics_shard_size: Int = -1
    """Hybrid sharding (DeepSpeed's MiCS, stages 1-3): shard the state over groups of this many consecutive
    ranks, replicated across the groups; must divide the world size (-1 or 0 = off: plain ZeRO)."""
    mics_hierarchical_params_gather: Bool = False
    """MiCS hierarchical all-gather: accepted, no effect (one all-gather over the shard group)."""
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


class OptimizerSpec(Block):
    """`optimizer`: the optimizer DeepSpeed would build; zeroshard's optimizer factory validates params."""

    type: Str
    """Optimizer name as written (e.g. "AdamW")."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Constructor arguments with "auto" resolved."""
    legacy_fusion: Bool = False
    """DeepSpeed's legacy fused-optimizer flag."""


class SchedulerSpec(Block):
    """`scheduler`: the learning-rate schedule DeepSpeed would build (e.g. "WarmupLR")."""

    type: Str
    """Scheduler name as written."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Scheduler arguments with "auto" resolved."""
