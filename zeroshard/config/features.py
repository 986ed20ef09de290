"""DeepSpeed settings zeroshard reads but does not act on, as data: the blocks of features zeroshard does
not implement (when a config turns each such feature on, and in-scope settings without effect, are in
`scope.py`).

The blocks of features zeroshard does not implement are declared as tables (see [Note: features as
data]) and checked against them, so that a typo inside them is still an error (with a did-you-mean), and
so that `checks.py` can tell whether a config turns the feature on. Defaults follow DeepSpeed 0.19.6
(`compile/config.py`, `runtime/tensor_parallel/config.py`, `runtime/constants.py`,
`autotuning/constants.py`, `elasticity/constants.py`, `runtime/config.py`, `nebula/constants.py`,
`profiling/constants.py`, `activation_checkpointing/config.py`). Blocks whose content DeepSpeed passes on
unchecked (amp, pipeline, compression_training, ...) are kept as given. The `elasticity` block is declared
here too, for its keys, types and defaults, although zeroshard applies it (`elasticity.py`, which also checks
its ranges, as DeepSpeed does, only when it is enabled).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from zeroshard.config.blocks import Bool, DtypeName, Float, Int, OptInt, OptStr, OptStrList, Str
from zeroshard.config.errors import Problems, show
from zeroshard.config.keys import record, unknown_key_message

__all__ = [
    "FEATURE_BLOCKS",
    "FeatureBlock",
    "Setting",
    "check_feature_blocks",
    "feature_defaults",
]

# [Note: features as data] A DeepSpeed feature zeroshard does not implement is declared by a table, not
# a typed model: each block maps its keys to (value type, DeepSpeed's default, what it does). The value
# type is a pydantic annotation from blocks.py, so values are checked (and messages worded) as in the
# typed blocks. `check_feature_blocks` checks a config's blocks against the tables and fills in the
# defaults; `OUT_OF_SCOPE` says when a block turns its feature on (`out_of_scope_warnings`), and
# `NO_EFFECT` lists the in-scope settings whose non-default value zeroshard does not act on.

Setting = tuple[Any, Any, str]
"""One key of a feature block: (value type as a pydantic annotation, or a nested `FeatureBlock`;
DeepSpeed's default; what it does)."""


@dataclass(frozen=True)
class FeatureBlock:
    """The keys of one block of a feature zeroshard does not implement.

    Attributes:
        doc: What the block is, for messages and docs.
        settings: Key -> `Setting`.
        aliases: Other spellings DeepSpeed accepts -> the key.
        removed: Keys DeepSpeed removed (and rejects) -> why.
        optional: Absent means None (DeepSpeed turns the feature on by the block's presence), not the
            defaults.
    """

    doc: str
    settings: Mapping[str, Setting]
    aliases: Mapping[str, str] = field(default_factory=dict)
    removed: Mapping[str, str] = field(default_factory=dict)
    optional: bool = False

    def defaults(self) -> dict[str, Any]:
        """The block as DeepSpeed fills it in when the config leaves it out (nested blocks included)."""
        return {
            key: kind.defaults() if isinstance(kind, FeatureBlock) else copy.copy(default)
            for key, (kind, default, _) in self.settings.items()
        }


_TP: dict[str, Setting] = {
    "tp_size": (Int, 1, "Tensor-parallel degree."),
    "tp_grain_size": (Int, 1, "Partition granularity."),
    "mpu": (Any, None, "Model-parallel unit (set from code, not JSON)."),
    "tp_group": (Any, None, "Process group (set from code, not JSON)."),
}

_COMPILE: dict[str, Setting] = {
    "deepcompile": (Bool, False, "DeepCompile mode."),
    "free_activation": (Bool, False, "Eagerly free activations."),
    "free_activation_threshold": (Int, 10 * 1024 * 1024, "Bytes above which activations are freed eagerly."),
    "offload_activation": (Bool, False, "Offload saved activations to host memory."),
    "offload_activation_pin_memory": (Bool, True, "Pin the host buffers of offloaded activations."),
    "offload_opt_states": (Bool, False, "Offload optimizer state during forward/backward."),
    "double_buffer": (Bool, True, "Double buffering."),
    "symmetric_memory": (Bool, False, "Symmetric memory."),
    "debug_log": (Bool, False, "Dump graphs."),
    "offload_parameters": (Bool, False, "Offload parameters."),
    "sync_before_reduce": (Bool, False, "Synchronize before reduce."),
    "sync_after_reduce": (Bool, False, "Synchronize after reduce."),
    "sync_before_allgather": (Bool, False, "Synchronize before all-gather."),
    "sync_after_allgather": (Bool, False, "Synchronize after all-gather."),
    "keep_int_input_tensors": (Bool, True, "Keep real values of int inputs."),
    "keep_all_input_tensors": (Bool, False, "Keep real values of all inputs."),
    "passes": (list[Literal["z1", "z3", "autosp", "autotp"]] | None, None, "Compiler passes."),
}

_TENSOR_PARALLEL: dict[str, Setting] = {
    "dtype": (Any, None, "Model dtype for AutoTP (DeepSpeed default torch.float16)."),
    "autotp_size": (Annotated[Int, Field(ge=0)], 0, "AutoTP degree; 0 (or 1) means off."),
    "tp_overlap_comm": (Bool, False, "Overlap TP all-reduce with compute."),
    "vocab_parallel_lm_head": (Bool | None, None, "Shard the vocabulary of the LM head (DeepSpeed 0.19.8)."),
    "vocab_parallel_ce_backend": (Literal["torch", "liger"], "torch", "Vocab-parallel cross-entropy kernel."),
    "tensor_parallel": (FeatureBlock("`tensor_parallel.tp`", _TP), None, "Inner TP settings (alias `tp`)."),
    "injection_policy_tuple": (Any, None, "Injection policy (set from code)."),
    "partition_config": (dict[str, Any] | None, None, "Custom AutoTP layer specs, kept as given."),
    "preset_model": (OptStr, None, "Built-in AutoTP preset."),
    "keep_module_on_host": (Bool, False, "Keep checkpoint tensors on the host while loading."),
    "replace_with_kernel_inject": (Bool, False, "Inject inference kernels (alias `kernel_inject`)."),
}

_SPARSE_ATTENTION: dict[str, Setting] = {
    "mode": (Literal["dense", "fixed", "variable", "bigbird", "bslongformer"], "fixed", "Layout family."),
    "block": (Int, 16, "Block size."),
    "different_layout_per_head": (Bool, False, "Separate layout per head."),
    "num_local_blocks": (Int, 4, "Local blocks (fixed)."),
    "num_global_blocks": (Int, 1, "Global blocks."),
    "attention": (Literal["bidirectional", "unidirectional"], "bidirectional", "Attention direction."),
    "horizontal_global_attention": (Bool, False, "Horizontal global attention."),
    "num_different_global_patterns": (Int, 1, "Distinct global patterns."),
    "num_random_blocks": (Int, 0, "Random blocks."),
    "local_window_blocks": (list[Int], [4], "Local window sizes (variable)."),
    "global_block_indices": (list[Int], [0], "Global block indices."),
    "global_block_end_indices": (list[Int] | None, None, "Global block end indices."),
    "num_sliding_window_blocks": (Int, 3, "Sliding-window blocks."),
}

_PROGRESSIVE_LAYER_DROP: dict[str, Setting] = {
    "enabled": (Bool, False, "Progressive layer dropping."),
    "theta": (Float, 1.0, "Keep-probability floor."),
    "gamma": (Float, 0.001, "Decay rate."),
}

_EIGENVALUE: dict[str, Setting] = {
    "enabled": (Bool, False, "Eigenvalue computation."),
    "verbose": (Bool, False, "Verbose output."),
    "max_iter": (Int, 100, "Power-iteration limit."),
    "tol": (Float, 0.01, "Tolerance."),
    "stability": (Float, 1e-6, "Stability term."),
    "gas_boundary_resolution": (Int, 1, "Steps between computations."),
    "layer_name": (Str, "bert.encoder.layer", "Module path of the layers."),
    "layer_num": (Int, 0, "Number of layers."),
}

_AUTOTUNING: dict[str, Setting] = {
    "enabled": (Bool, False, "Autotuning."),
    "fast": (Bool, True, "Fast mode."),
    "results_dir": (Str, "autotuning_results", "Results directory."),
    "exps_dir": (Str, "autotuning_exps", "Experiments directory."),
    "overwrite": (Bool, True, "Overwrite earlier results."),
    "start_profile_step": (Int, 3, "First profiled step."),
    "end_profile_step": (Int, 5, "Last profiled step."),
    "metric_path": (OptStr, None, "Metric output file."),
    "tuner_type": (Literal["gridsearch", "random", "model_based"], "gridsearch", "Search strategy."),
    "tuner_early_stopping": (Int, 5, "Trials without improvement before stopping."),
    "tuner_num_trials": (Int, 50, "Maximum trials."),
    "arg_mappings": (dict[str, Any] | None, None, "Mapping of config keys to script arguments."),
    "max_train_batch_size": (OptInt, None, "Largest train batch size tried."),
    "min_train_batch_size": (Int, 1, "Smallest train batch size tried."),
    "max_train_micro_batch_size_per_gpu": (Int, 1024, "Largest micro batch tried."),
    "min_train_micro_batch_size_per_gpu": (Int, 1, "Smallest micro batch tried."),
    "num_tuning_micro_batch_sizes": (Int, 3, "Micro batch sizes tried."),
    "mp_size": (Int, 1, "Model-parallel size."),
    "metric": (
        Literal["latency", "throughput", "flops", "forward", "step"],
        "throughput",
        "Metric optimised.",
    ),
    "model_info_path": (OptStr, None, "Model info file."),
    "model_info": (dict[str, Any] | None, None, "Model info, kept as given."),
}

_ELASTICITY: dict[str, Setting] = {
    "enabled": (Bool, False, "Choose the batch triad by DeepSpeed's elastic search."),
    "max_train_batch_size": (Int, 2000, "Largest acceptable train batch size."),
    "micro_batch_sizes": (list[Int], [2, 4, 6], "Acceptable micro batch sizes."),
    "min_gpus": (Int, 1, "Fewest GPUs the batch must suit."),
    "max_gpus": (Int, 10000, "Most GPUs the batch must suit."),
    "num_gpus_per_node": (Int, 1, "GPUs per node (version 0.2 searches over nodes)."),
    "model_parallel_size": (Int, 1, "Model-parallel size (above 1 needs version 0.2)."),
    "min_time": (Float, 0, "Minutes before a scheduler may rescale the job (read by schedulers only)."),
    "prefer_larger_batch": (Bool, True, "Among equally elastic batches, take the larger."),
    "ignore_non_elastic_batch_info": (
        Bool,
        False,
        "Replace batch keys given beside the block, not refuse them.",
    ),
    "version": (Float, 0.2, "Search version: 0.1 (per GPU) or 0.2 (per node)."),
}

_HYBRID_ENGINE: dict[str, Setting] = {
    "enabled": (Bool, False, "Hybrid engine."),
    "max_out_tokens": (Int, 512, "Generation length."),
    "inference_tp_size": (Int, 1, "Inference tensor-parallel size."),
    "release_inference_cache": (Bool, False, "Free the inference cache after generating."),
    "pin_parameters": (Bool, True, "Pin parameters."),
    "tp_gather_partition_size": (Int, 8, "Gather partition size."),
    "enable_cuda_graph": (Bool, False, "CUDA graphs."),
}

_NEBULA: dict[str, Setting] = {
    "enabled": (Bool, False, "Nebula checkpointing."),
    "persistent_storage_path": (OptStr, None, "Persistent storage directory."),
    "persistent_time_interval": (Int, 100, "Seconds between persists."),
    "num_of_version_in_retention": (Int, 2, "Checkpoints kept."),
    "enable_nebula_load": (Bool, True, "Load through Nebula."),
    "nebula_load_path": (OptStr, None, "Load directory."),
}

_TORCH_AUTOCAST: dict[str, Setting] = {
    "enabled": (Bool, False, "Run forward under torch.autocast."),
    "dtype": (DtypeName, None, "Autocast dtype."),
    "lower_precision_safe_modules": (
        OptStrList,
        None,
        "Module classes allowed to run in the lower precision.",
    ),
}

_FLOPS_PROFILER: dict[str, Setting] = {
    "enabled": (Bool, False, "Profile one step."),
    "recompute_fwd_factor": (Float, 0.0, "Share of forward recomputed in backward."),
    "profile_step": (Int, 1, "Step to profile."),
    "module_depth": (Int, -1, "Depth of the module tree printed."),
    "top_modules": (Int, 1, "Top modules listed."),
    "detailed": (Bool, True, "Print the per-module profile."),
    "output_file": (OptStr, None, "File for the profile; None prints it."),
}

_ACTIVATION_CHECKPOINTING: dict[str, Setting] = {
    "partition_activations": (Bool, False, "Shard checkpointed activations across model-parallel ranks."),
    "number_checkpoints": (OptInt, None, "Checkpoints per forward pass."),
    "contiguous_memory_optimization": (Bool, False, "Copy checkpoints into a contiguous buffer."),
    "synchronize_checkpoint_boundary": (Bool, False, "Synchronize at checkpoint boundaries."),
    "profile": (Bool, False, "Profile checkpointing."),
    "cpu_checkpointing": (Bool, False, "Keep checkpoints on the CPU."),
}


_REMOVED_FROM_COMPILE = "was removed from DeepSpeed's compile block (DeepSpeed rejects it too)"

FEATURE_BLOCKS: dict[str, FeatureBlock] = {
    "compile": FeatureBlock(
        "DeepSpeed's torch.compile / DeepCompile settings",
        _COMPILE,
        removed=dict.fromkeys(("disable", "backend", "kwargs"), _REMOVED_FROM_COMPILE),
    ),
    "tensor_parallel": FeatureBlock(
        "DeepSpeed's AutoTP training settings",
        _TENSOR_PARALLEL,
        aliases={"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"},
    ),
    "sparse_attention": FeatureBlock(
        "DeepSpeed's block-sparse attention layouts", _SPARSE_ATTENTION, optional=True
    ),
    "progressive_layer_drop": FeatureBlock("progressive layer drop", _PROGRESSIVE_LAYER_DROP),
    "eigenvalue": FeatureBlock(
        "eigenvalue computation (legacy top-level spelling; DeepSpeed now reads it inside quantize_training)",
        _EIGENVALUE,
    ),
    "autotuning": FeatureBlock(
        "DeepSpeed's autotuner (run by the `deepspeed --autotuning` launcher)", _AUTOTUNING
    ),
    "elasticity": FeatureBlock("DeepSpeed's elastic batch-size search", _ELASTICITY),
    "hybrid_engine": FeatureBlock("DeepSpeed-Chat's train/generate engine", _HYBRID_ENGINE),
    "nebula": FeatureBlock("Azure Nebula asynchronous checkpointing", _NEBULA),
    "torch_autocast": FeatureBlock("DeepSpeed's torch.autocast integration", _TORCH_AUTOCAST),
    "flops_profiler": FeatureBlock("DeepSpeed's FLOPs profiler", _FLOPS_PROFILER),
    "activation_checkpointing": FeatureBlock(
        "DeepSpeed's activation checkpointing API", _ACTIVATION_CHECKPOINTING
    ),
}
"""The typed-by-table blocks of features zeroshard does not implement, by top-level key."""


def feature_defaults(key: str) -> dict[str, Any] | None:
    """The value `ZeroshardConfig` holds for feature block `key` when the config leaves it out."""
    block = FEATURE_BLOCKS[key]
    return None if block.optional else block.defaults()


@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def _check_block(block: FeatureBlock, given: Any, path: str, problems: Problems) -> dict[str, Any]:
    """`given` checked against `block`, with DeepSpeed's defaults for what it leaves out."""
    out = block.defaults()
    if given is None:
        return out
    if not isinstance(given, Mapping):
        problems.add(f"{path}: {show(given)} is not allowed; expected an object ({{...}})", type_error=True)
        return out
    spelled: dict[str, str] = {}
    for key, value in given.items():
        if not isinstance(key, str):
            problems.add(f"{path}.{key!r}: keys must be strings", type_error=True)
            continue
        if key.startswith("_"):  # a comment
            continue
        where = f"{path}.{key}"
        name = block.aliases.get(key, key)
        if key in block.removed:
            problems.add(f"{where}: {block.removed[key]}; delete it")
            continue
        if name not in block.settings:
            problems.add(unknown_key_message(where, key, [*block.settings, *block.aliases]))
            continue
        if name in spelled:
            problems.add(f"{where}: the same setting is also given as '{spelled[name]}'; keep one of them")
            continue
        spelled[name] = key
        if isinstance(value, str) and value == "auto":  # DeepSpeed's pydantic blocks drop "auto"
            continue
        kind = block.settings[name][0]
        if isinstance(kind, FeatureBlock):
            out[name] = _check_block(kind, value, where, problems)
            continue
        try:
            out[name] = _adapter(kind).validate_python(value)
        except ValidationError as err:
            for item in err.errors(include_url=False):
                record(item, where + "".join(f"[{part}]" for part in item["loc"]), problems)
    return out


def check_feature_blocks(data: Mapping[str, Any], problems: Problems) -> dict[str, Any]:
    """Checks the config's feature blocks against `FEATURE_BLOCKS` (see [Note: features as data]).

    Args:
        data: The top-level config with canonical keys (see `keys.canonicalize`).
        problems: Where unknown keys and wrong values are recorded, named by their dotted key.

    Returns:
        A copy of `data` whose feature blocks are complete (DeepSpeed's defaults filled in).
    """
    out = dict(data)
    for key, block in FEATURE_BLOCKS.items():
        if key in out and not (block.optional and out[key] is None):
            out[key] = _check_block(block, out[key], key, problems)
    return out
