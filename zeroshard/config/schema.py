"""`ZeroshardConfig`: the resolved, validated form of a DeepSpeed ds_config.

Every field mirrors a ds_config key under DeepSpeed's name. After `load_config` there is no "auto" left
and no None where DeepSpeed has a default; None remains only where DeepSpeed's own default is None
(`steps_per_print`, `communication_data_type`, an absent optimizer, ...). Defaults are DeepSpeed 0.19.6's
and are listed in docs/config.md.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from zeroshard.config.blocks import (
    AioConfig,
    BF16Config,
    Block,
    Bool,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    DataTypesConfig,
    DtypeName,
    Float,
    FP16Config,
    Int,
    OptimizerSpec,
    OptInt,
    SchedulerSpec,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
    ZeroConfig,
    coerce_int,
)
from zeroshard.config.features import feature_defaults

__all__ = ["ZeroshardConfig"]

_Positive = Annotated[Int, Field(gt=0)]
_Opaque = dict[str, Any] | None
_Feature = dict[str, Any]
"""A block of a feature zeroshard does not implement, checked against its table in features.py with
DeepSpeed's defaults filled in (see [Note: features as data])."""


def _defaults(key: str) -> Any:
    return Field(default_factory=functools.partial(feature_defaults, key))


def _print_every(value: Any) -> Any:
    # accelerate writes float("inf") for "never"; zeroshard stores that as None.
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    return coerce_int(value)


_PrintEvery = Annotated[Annotated[int, Field(ge=1)] | None, BeforeValidator(_print_every)]


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


class ZeroshardConfig(Block):
    """A resolved ds_config.

    Invariants: `train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size`; `fp16.enabled` and `bf16.enabled` are not both true; `zero_optimization.overlap_comm`
    is resolved. `warnings` holds every `ConfigWarning` message `load_config` emitted for this config.
    """

    world_size: _Positive
    """Data-parallel world size the batch sizes were resolved for."""
    train_batch_size: _Positive
    """Samples per optimizer step over all ranks."""
    train_micro_batch_size_per_gpu: _Positive
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: _Positive
    """Micro-batches accumulated per optimizer step."""
    managed_gradient_accumulation: Bool = True
    """DeepSpeed tracks accumulation boundaries itself (false: every step() updates)."""
    steps_per_print: _PrintEvery = None
    """Log progress every this many steps; None (or Infinity, as accelerate writes) turns it off."""
    wall_clock_breakdown: Bool = False
    """Time forward, backward and step separately."""
    disable_python_gc: Bool = False
    """Turn Python's automatic cyclic garbage collection off while an engine lives (DeepSpeed 0.19.8);
    collect at safe points with ``engine.collect_python_gc()`` (runtime/python_gc.py)."""
    memory_breakdown: Bool = False
    """Log allocator memory during the step (no effect in zeroshard, which warns when true; its log line
    and `engine.memory_breakdown()` report this rank's bytes)."""
    dataloader_drop_last: Bool = False
    """Drop the last incomplete batch in the engine's data loader."""
    gradient_clipping: Annotated[Float, Field(ge=0.0)] = 1.0
    """Global gradient-norm clip; 0 turns clipping off (DeepSpeed 0.19.6 default 1.0)."""
    prescale_gradients: Bool = False
    """Divide gradients before (not after) the reduction."""
    gradient_predivide_factor: Annotated[Float, Field(gt=0.0)] = 1.0
    """Factor gradients are divided by before the reduction."""
    gradient_allreduce_op: Annotated[Literal["mean", "sum"], BeforeValidator(_lower)] = "mean"
    """Whether reduced gradients are averaged or summed over ranks; zeroshard always averages and warns
    on "sum"."""
    communication_data_type: DtypeName = None
    """Dtype of gradient communication ("fp32", "fp16", "bf16"); None follows the precision mode."""
    seq_parallel_communication_data_type: DtypeName = "fp32"
    """Sequence-parallel communication dtype (no effect in zeroshard)."""
    sparse_gradients: Bool = False
    """Reduce embedding gradients as sparse tensors (no effect in zeroshard, which warns when true)."""
    zero_allow_untested_optimizer: Bool = False
    """Allow a client optimizer DeepSpeed has not tested with ZeRO."""
    zero_force_ds_cpu_optimizer: Bool = True
    """With optimizer offload, require DeepSpeed's CPU optimizer."""
    disable_allgather: Bool = False
    """Legacy DeepSpeed switch."""
    dump_state: Bool = False
    """Print the engine state after initialisation."""
    graph_harvesting: Bool = False
    """Capture short kernel sequences as graphs."""
    use_data_before_expert_parallelism: Bool = False
    """Expert/data parallel topology order (MoE)."""
    vocabulary_size: OptInt = None
    """Vocabulary size, used by DeepSpeed only for an alignment warning."""
    log_level: Any = None
    """DeepSpeed's log level."""
    sequence_parallel_size: OptInt = None
    """Sequence-parallel degree (no effect in zeroshard)."""
    data_parallel_size: OptInt = None
    """Data-parallel degree for DeepSpeed's sequence-parallel mesh (no effect in zeroshard)."""

    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and its settings."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision."""
    bf16: BF16Config = Field(default_factory=BF16Config)
    """bfloat16 mixed precision (also read from the legacy key `bfloat16`)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Dtype overrides."""
    optimizer: OptimizerSpec | None = None
    """Optimizer from the config, None when the client passes one."""
    scheduler: SchedulerSpec | None = None
    """Learning-rate scheduler from the config."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous I/O for NVMe offload."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint settings."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """CSV monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Collective-communication logger."""
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """Timers."""
    flops_profiler: _Feature = _defaults("flops_profiler")
    """FLOPs profiler (no effect in zeroshard); keys and defaults in features.py."""
    activation_checkpointing: _Feature = _defaults("activation_checkpointing")
    """DeepSpeed's activation checkpointing API (no effect in zeroshard)."""

    torch_autocast: _Feature = _defaults("torch_autocast")
    """torch.autocast integration (no effect in zeroshard)."""
    compile: _Feature = _defaults("compile")
    """Compile settings (no effect in zeroshard)."""
    tensor_parallel: _Feature = _defaults("tensor_parallel")
    """AutoTP (no effect in zeroshard)."""
    sparse_attention: _Feature | None = None
    """Sparse attention (no effect in zeroshard)."""
    progressive_layer_drop: _Feature = _defaults("progressive_layer_drop")
    """Progressive layer drop (no effect in zeroshard)."""
    eigenvalue: _Feature = _defaults("eigenvalue")
    """Eigenvalue computation (no effect in zeroshard)."""
    autotuning: _Feature = _defaults("autotuning")
    """Autotuner (no effect in zeroshard)."""
    elasticity: _Feature = _defaults("elasticity")
    """DeepSpeed's elastic batch search; when enabled, it sets the batch triad (`elasticity.py`)."""
    hybrid_engine: _Feature = _defaults("hybrid_engine")
    """Hybrid engine (no effect in zeroshard)."""
    nebula: _Feature = _defaults("nebula")
    """Nebula checkpointing (no effect in zeroshard)."""
    amp: _Opaque = None
    """Apex AMP arguments, kept as given (no effect in zeroshard)."""
    pipeline: _Opaque = None
    """Pipeline-engine settings, kept as given (no effect in zeroshard)."""
    compression_training: _Opaque = None
    """Compression training, kept as given (no effect in zeroshard)."""
    data_efficiency: _Opaque = None
    """Data efficiency library, kept as given (no effect in zeroshard)."""
    curriculum_learning: _Opaque = None
    """Legacy curriculum learning, kept as given (no effect in zeroshard)."""
    quantize_training: _Opaque = None
    """MoQ quantize-aware training, kept as given (no effect in zeroshard)."""
    expert_parallel: _Opaque = None
    """AutoEP settings, kept as given (no effect in zeroshard)."""
    weight_quantization: _Opaque = None
    """Inference weight quantization, kept as given (no effect in zeroshard)."""
    datastates_ckpt: Any = None
    """DataStates asynchronous checkpointing, kept as given (no effect in zeroshard)."""

    warnings: tuple[str, ...] = ()
    """Messages of the ConfigWarnings emitted while loading."""

    def to_dict(self) -> dict[str, Any]:
        """Returns the resolved config as a JSON-serialisable dict (without `warnings`), for logging.

        Objects a dict config may carry (an mpu in `tensor_parallel.tp`) appear as their repr.
        """
        plain: dict[str, Any] = json.loads(json.dumps(self.model_dump(exclude={"warnings"}), default=repr))
        return plain

    def dump(self) -> str:
        """Returns the resolved config as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)
