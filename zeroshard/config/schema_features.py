"""Blocks of DeepSpeed features that zeroshard does not implement.

They are typed so that a typo inside them is still an error (with a did-you-mean), and so that
`outofscope.py` can tell whether a config turns the feature on. Values follow DeepSpeed 0.19.6
(`compile/config.py`, `runtime/tensor_parallel/config.py`, `runtime/constants.py`,
`autotuning/constants.py`, `elasticity/constants.py`, `runtime/config.py`, `nebula/constants.py`).
Blocks whose content DeepSpeed passes on unchecked (amp, pipeline, compression_training, ...) are kept
as plain dicts on `ZeroshardConfig` instead.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from zeroshard.config.base import Block, Bool, Float, Int, OptInt, OptStr, Str

__all__ = [
    "AutotuningConfig",
    "CompileConfig",
    "EigenvalueConfig",
    "ElasticityConfig",
    "HybridEngineConfig",
    "NebulaConfig",
    "ProgressiveLayerDropConfig",
    "SparseAttentionConfig",
    "TPConfig",
    "TensorParallelConfig",
]


class CompileConfig(Block):
    """`compile`: DeepSpeed's torch.compile / DeepCompile settings.

    The removed keys `disable`, `backend` and `kwargs` are rejected, as DeepSpeed does.
    """

    deepcompile: Bool = False
    """DeepCompile mode."""
    free_activation: Bool = False
    """Eagerly free activations."""
    free_activation_threshold: Int = 10 * 1024 * 1024
    """Bytes above which activations are freed eagerly."""
    offload_activation: Bool = False
    """Offload saved activations to host memory."""
    offload_activation_pin_memory: Bool = True
    """Pin the host buffers of offloaded activations."""
    offload_opt_states: Bool = False
    """Offload optimizer state during forward/backward."""
    double_buffer: Bool = True
    """Double buffering."""
    symmetric_memory: Bool = False
    """Symmetric memory."""
    debug_log: Bool = False
    """Dump graphs."""
    offload_parameters: Bool = False
    """Offload parameters."""
    sync_before_reduce: Bool = False
    """Synchronize before reduce."""
    sync_after_reduce: Bool = False
    """Synchronize after reduce."""
    sync_before_allgather: Bool = False
    """Synchronize before all-gather."""
    sync_after_allgather: Bool = False
    """Synchronize after all-gather."""
    keep_int_input_tensors: Bool = True
    """Keep real values of int inputs."""
    keep_all_input_tensors: Bool = False
    """Keep real values of all inputs."""
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    """Compiler passes."""


class TPConfig(Block):
    """`tensor_parallel.tp` (alias `tensor_parallel.tensor_parallel`)."""

    tp_size: Int = 1
    """Tensor-parallel degree."""
    tp_grain_size: Int = 1
    """Partition granularity."""
    mpu: Any = None
    """Model-parallel unit (set from code, not JSON)."""
    tp_group: Any = None
    """Process group (set from code, not JSON)."""


class TensorParallelConfig(Block):
    """`tensor_parallel`: DeepSpeed's AutoTP training settings."""

    input_aliases: ClassVar[dict[str, str]] = {
        "tp": "tensor_parallel",
        "kernel_inject": "replace_with_kernel_inject",
    }

    dtype: Any = None
    """Model dtype for AutoTP (DeepSpeed default torch.float16)."""
    autotp_size: Annotated[Int, Field(ge=0)] = 0
    """AutoTP degree; 0 (or 1) means off."""
    tp_overlap_comm: Bool = False
    """Overlap TP all-reduce with compute."""
    tensor_parallel: TPConfig = Field(default_factory=TPConfig)
    """Inner TP settings (alias `tp`)."""
    injection_policy_tuple: Any = None
    """Injection policy (set from code)."""
    partition_config: dict[str, Any] | None = None
    """Custom AutoTP layer specs, kept as given."""
    preset_model: OptStr = None
    """Built-in AutoTP preset."""
    keep_module_on_host: Bool = False
    """Keep checkpoint tensors on the host while loading."""
    replace_with_kernel_inject: Bool = False
    """Inject inference kernels (alias `kernel_inject`)."""


class SparseAttentionConfig(Block):
    """`sparse_attention`: DeepSpeed's block-sparse attention layouts."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    """Layout family."""
    block: Int = 16
    """Block size."""
    different_layout_per_head: Bool = False
    """Separate layout per head."""
    num_local_blocks: Int = 4
    """Local blocks (fixed)."""
    num_global_blocks: Int = 1
    """Global blocks."""
    attention: Literal["bidirectional", "unidirectional"] = "bidirectional"
    """Attention direction."""
    horizontal_global_attention: Bool = False
    """Horizontal global attention."""
    num_different_global_patterns: Int = 1
    """Distinct global patterns."""
    num_random_blocks: Int = 0
    """Random blocks."""
    local_window_blocks: list[Int] = Field(default_factory=lambda: [4])
    """Local window sizes (variable)."""
    global_block_indices: list[Int] = Field(default_factory=lambda: [0])
    """Global block indices."""
    global_block_end_indices: list[Int] | None = None
    """Global block end indices."""
    num_sliding_window_blocks: Int = 3
    """Sliding-window blocks."""


class ProgressiveLayerDropConfig(Block):
    """`progressive_layer_drop`."""

    enabled: Bool = False
    """Progressive layer dropping."""
    theta: Float = 1.0
    """Keep-probability floor."""
    gamma: Float = 0.001
    """Decay rate."""


class EigenvalueConfig(Block):
    """`eigenvalue` (legacy top-level spelling; DeepSpeed now reads it inside quantize_training)."""

    enabled: Bool = False
    """Eigenvalue computation."""
    verbose: Bool = False
    """Verbose output."""
    max_iter: Int = 100
    """Power-iteration limit."""
    tol: Float = 0.01
    """Tolerance."""
    stability: Float = 1e-6
    """Stability term."""
    gas_boundary_resolution: Int = 1
    """Steps between computations."""
    layer_name: Str = "bert.encoder.layer"
    """Module path of the layers."""
    layer_num: Int = 0
    """Number of layers."""


class AutotuningConfig(Block):
    """`autotuning`: DeepSpeed's autotuner (run by the `deepspeed --autotuning` launcher)."""

    enabled: Bool = False
    """Autotuning."""
    fast: Bool = True
    """Fast mode."""
    results_dir: Str = "autotuning_results"
    """Results directory."""
    exps_dir: Str = "autotuning_exps"
    """Experiments directory."""
    overwrite: Bool = True
    """Overwrite earlier results."""
    start_profile_step: Int = 3
    """First profiled step."""
    end_profile_step: Int = 5
    """Last profiled step."""
    metric_path: OptStr = None
    """Metric output file."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Search strategy."""
    tuner_early_stopping: Int = 5
    """Trials without improvement before stopping."""
    tuner_num_trials: Int = 50
    """Maximum trials."""
    arg_mappings: dict[str, Any] | None = None
    """Mapping of config keys to script arguments."""
    max_train_batch_size: OptInt = None
    """Largest train batch size tried."""
    min_train_batch_size: Int = 1
    """Smallest train batch size tried."""
    max_train_micro_batch_size_per_gpu: Int = 1024
    """Largest micro batch tried."""
    min_train_micro_batch_size_per_gpu: Int = 1
    """Smallest micro batch tried."""
    num_tuning_micro_batch_sizes: Int = 3
    """Micro batch sizes tried."""
    mp_size: Int = 1
    """Model-parallel size."""
    metric: Literal["latency", "throughput", "flops", "forward", "step"] = "throughput"
    """Metric optimised."""
    model_info_path: OptStr = None
    """Model info file."""
    model_info: dict[str, Any] | None = None
    """Model info, kept as given."""


class ElasticityConfig(Block):
    """`elasticity`: DeepSpeed's elastic batch-size search."""

    enabled: Bool = False
    """Elastic training."""
    max_train_batch_size: Int = 2000
    """Largest acceptable train batch size."""
    micro_batch_sizes: list[Int] = Field(default_factory=lambda: [2, 4, 6])
    """Acceptable micro batch sizes."""
    min_gpus: Int = 1
    """Fewest GPUs."""
    max_gpus: Int = 10000
    """Most GPUs."""
    num_gpus_per_node: Int = 1
    """GPUs per node."""
    model_parallel_size: Int = 1
    """Model-parallel size."""
    min_time: Int = 0
    """Minutes before rescaling."""
    prefer_larger_batch: Bool = True
    """Prefer the larger batch size."""
    ignore_non_elastic_batch_info: Bool = False
    """Ignore batch keys outside the elasticity block."""
    version: Float = 0.2
    """Elasticity algorithm version."""


class HybridEngineConfig(Block):
    """`hybrid_engine`: DeepSpeed-Chat's train/generate engine."""

    enabled: Bool = False
    """Hybrid engine."""
    max_out_tokens: Int = 512
    """Generation length."""
    inference_tp_size: Int = 1
    """Inference tensor-parallel size."""
    release_inference_cache: Bool = False
    """Free the inference cache after generating."""
    pin_parameters: Bool = True
    """Pin parameters."""
    tp_gather_partition_size: Int = 8
    """Gather partition size."""
    enable_cuda_graph: Bool = False
    """CUDA graphs."""


class NebulaConfig(Block):
    """`nebula`: Azure Nebula asynchronous checkpointing."""

    enabled: Bool = False
    """Nebula checkpointing."""
    persistent_storage_path: OptStr = None
    """Persistent storage directory."""
    persistent_time_interval: Int = 100
    """Seconds between persists."""
    num_of_version_in_retention: Int = 2
    """Checkpoints kept."""
    enable_nebula_load: Bool = True
    """Load through Nebula."""
    nebula_load_path: OptStr = None
    """Load directory."""
