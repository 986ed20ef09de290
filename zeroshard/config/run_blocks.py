"""The ds_config blocks that shape a run's I/O and reporting, not its numerics: `aio`, `checkpoint`,
the monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`), `comms_logger` and `timers`.

Defaults are DeepSpeed 0.19.6's (`runtime/swap_tensor/constants.py`, `runtime/model_checkpointing/`,
`monitor/config.py`, `comm/config.py`, `utils/config.py`); `docs/config.md` lists them all.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from zeroshard.config.values import Block, Bool, OptBool, OptStr, PositiveInt, Str, StrList, upper


class AioConfig(Block):
    """`aio`: asynchronous NVMe I/O settings (legacy `thread_count` is read as `intra_op_parallelism`)."""

    block_size: PositiveInt = 1_048_576
    """Bytes per I/O request."""
    queue_depth: PositiveInt = 8
    """Outstanding requests per submission queue."""
    intra_op_parallelism: PositiveInt = 1
    """Threads that split one tensor's I/O."""
    single_submit: Bool = False
    """Submit requests one at a time instead of batched."""
    overlap_events: Bool = True
    """Overlap submission and completion."""
    use_gds: Bool = False
    """Use GPUDirect Storage."""


class ParallelWriteConfig(Block):
    """`checkpoint.parallel_write`."""

    pipeline_stage: Bool = False
    """Write pipeline-stage checkpoints in parallel."""


class CheckpointWriterConfig(Block):
    """`checkpoint.writer`: DeepSpeed's fast checkpoint writer; zeroshard reads `decoupled` only."""

    type: Annotated[Literal["MOCK", "PYTHON", "FAST"], BeforeValidator(upper)] = "FAST"
    """Writer implementation."""
    io_buffer_size: PositiveInt = 64 * 1024**2
    """Bytes of the I/O buffer."""
    io_buffer_double: Bool = True
    """Double-buffer writes."""
    show_statistics: Bool = False
    """Log write statistics."""
    data_parallel: Annotated[Literal["REPLICA", "SOCKET", "MACHINE"] | None, BeforeValidator(upper)] = None
    """How data-parallel ranks share the write."""
    decoupled: Bool = False
    """Save in the background: the default of ``save_checkpoint(async_save=...)`` (docs/checkpoints.md)."""
    io_multiplier: PositiveInt = 1
    """Writer I/O multiplier."""


class CheckpointConfig(Block):
    """`checkpoint`: checkpoint tagging and writing."""

    tag_validation: Annotated[Literal["WARN", "IGNORE", "FAIL"], BeforeValidator(upper)] = "WARN"
    """What to do when ranks save under different tags."""
    load_universal: Bool = False
    """Load a universal (resharded) checkpoint."""
    use_node_local_storage: Bool = False
    """Each node saves to its own local storage."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel writes of pipeline stages."""
    checkpoint_serialization: Bool = True
    """Serialize with torch.save's zipfile format."""
    writer: CheckpointWriterConfig | None = None
    """Fast writer settings, None for the default torch.save path."""


class TensorBoardConfig(Block):
    """`tensorboard` monitor."""

    enabled: Bool = False
    """Log to TensorBoard."""
    output_path: Str = ""
    """Log directory; empty means the launch directory."""
    job_name: Str = "DeepSpeedJobName"
    """Sub-directory for this job."""


class WandbConfig(Block):
    """`wandb` monitor."""

    enabled: Bool = False
    """Log to Weights & Biases."""
    group: OptStr = None
    """Run group."""
    team: OptStr = None
    """Team (entity)."""
    project: Str = "deepspeed"
    """Project."""


class CSVConfig(Block):
    """`csv_monitor`."""

    enabled: Bool = False
    """Log to CSV files."""
    output_path: Str = ""
    """Output directory; empty means the launch directory."""
    job_name: Str = "DeepSpeedJobName"
    """Sub-directory for this job."""


class CometConfig(Block):
    """`comet` monitor."""

    enabled: Bool = False
    """Log to Comet."""
    samples_log_interval: PositiveInt = 100
    """Samples between submissions."""
    project: OptStr = None
    """Project name."""
    workspace: OptStr = None
    """Workspace name."""
    api_key: OptStr = None
    """API key (prefer the COMET_API_KEY environment variable)."""
    experiment_name: OptStr = None
    """Experiment name."""
    experiment_key: OptStr = None
    """Experiment key."""
    online: OptBool = None
    """Log online (None = Comet's default)."""
    mode: OptStr = None
    """"get", "create" or "get_or_create"."""


class CommsLoggerConfig(Block):
    """`comms_logger`: per-collective logging."""

    enabled: Bool = False
    """Log collectives."""
    prof_all: Bool = True
    """Profile every collective."""
    prof_ops: StrList = Field(default_factory=list)
    """Collectives to profile when prof_all is false."""
    verbose: Bool = False
    """Log every call."""
    debug: Bool = False
    """Include the caller."""


class ThroughputTimerConfig(Block):
    """`timers.throughput`."""

    enabled: Bool = True
    """Measure throughput."""
    synchronized: Bool = True
    """Synchronize the device when timing."""


class TimersConfig(Block):
    """`timers`."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """Throughput timer."""
