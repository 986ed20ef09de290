"""Model-state memory per GPU, per node's CPU and per node's NVMe, for every ZeRO stage and offload option.

`estimate_memory` answers "will it fit?" before any process starts, from the ZeRO paper's formulas (the
same `zeroshard.core.memory.predict` that `engine.memory_breakdown()` reports next to what it measures).
`zeroshard estimate` is its command line.

[Note: estimator assumptions]
Model states only: parameters, gradients and optimizer state (with the fp32 master copy of mixed
precision). Activations, the transient gradient buckets (at stages 1-2 at most three buckets of
``min(reduce_bucket_size, 2**22)`` elements or the largest parameter, see ``core/units.py`` [Note: bounded
units]), the allocator's fragmentation and the framework's own buffers come on top. With N parameters,
W = gpus_per_node * nodes ranks, c bytes per parameter in the compute dtype (2 for bf16/fp16, 4 for
fp32), g bytes per gradient (the same) and S = K + m bytes of optimizer state per parameter (K = 8 for
Adam's two fp32 moments, m = 4 for the fp32 master copy that mixed precision keeps, 0 in fp32), one rank
holds:

==================  =================  ==================  ====================  ======================
offload             GPU parameters     GPU gradients       GPU optimizer state   host (CPU or NVMe)
==================  =================  ==================  ====================  ======================
none (stage 0..3)   see [Note: ZeRO memory formulas] in zeroshard/core/memory.py         0
optimizer           c·N (c·N/W at 3)   g·N at stage 1,     0                     (S + 4)·N/W
                                       else 0
optimizer + param   0                  0                   0                     (c + S + 4)·N/W
==================  =================  ==================  ====================  ======================

With the optimizer offloaded, each rank's gradient shard is copied to the host as fp32 (the 4 in S + 4)
for the optimizer step there; at stages 2 and 3 the GPU keeps no gradient between backward passes, at
stage 1 it keeps the full gradient it accumulates. Stage 3 also gathers one layer at a time on the GPU:
its parameters and gradient, (c + g)·L bytes for the largest layer of L parameters; that working set is
counted only when the largest layer is given. Host bytes are reported per node (gpus_per_node ranks); with
NVMe offload they move from the CPU column to the NVMe column. For mixed-precision Adam and no offload the
GPU totals are the paper's 16N, 4N + 12N/W, 2N + 14N/W and 16N/W; for 7B parameters on 8 GPUs, 112 GB,
38.5 GB, 26.25 GB and 14 GB. With hybrid sharding (``mics_shard_size`` S, core/hybrid.py) the state is
sharded over S ranks: the same formulas with S in place of W, and no offload rows (hybrid sharding keeps
the state in device memory). With ZeRO++'s hpZ (``zero_hpz_partition_size`` H, stage 3) each GPU also keeps
its secondary shards, c·N/H bytes counted with the parameters, and there are no offload rows either.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zeroshard.core.hybrid import check_hpz_size, check_shard_size, hpz_on
from zeroshard.core.memory import ADAM_STATE_BYTES, Predicted, predict

__all__ = [
    "DTYPE_BYTES",
    "OFFLOAD_OPTIONS",
    "EstimateRow",
    "MemoryEstimate",
    "ModelSize",
    "OffloadOption",
    "estimate_memory",
    "model_size_from_hf_config",
]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per parameter (and per gradient) in each compute dtype the estimator knows."""

FP32_GRAD_BYTES = 4
"""The gradient copy an offloaded optimizer steps on is fp32."""

Device = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class OffloadOption:
    """Where an offload option puts the optimizer state and the parameters, and at which stages it exists."""

    name: str
    """The option's name on the command line and in the table."""
    optimizer: Device
    """Device of the optimizer state (and the fp32 gradient copy it steps on)."""
    param: Device
    """Device of the parameter shard (stage 3 only)."""
    stages: tuple[int, ...]
    """The ZeRO stages that support it (DeepSpeed: NVMe and parameter offload need stage 3)."""


OFFLOAD_OPTIONS: dict[str, OffloadOption] = {
    option.name: option
    for option in (
        OffloadOption("none", "none", "none", (0, 1, 2, 3)),
        OffloadOption("optimizer-cpu", "cpu", "none", (1, 2, 3)),
        OffloadOption("optimizer-nvme", "nvme", "none", (3,)),
        OffloadOption("optimizer+param-cpu", "cpu", "cpu", (3,)),
        OffloadOption("optimizer+param-nvme", "nvme", "nvme", (3,)),
    )
}
"""Every offload option, by name, in table order."""


@dataclass(frozen=True)
class EstimateRow:
    """Model-state bytes for one stage and offload option (see [Note: estimator assumptions]).

    Invariant: `per_gpu == gpu.total + gpu_working`.
    """

    stage: int
    offload: str
    """Name of the `OffloadOption`."""
    gpu: Predicted
    """Parameters, gradients and optimizer state that stay on one GPU between steps."""
    gpu_working: int
    """Stage 3's gathered largest layer (parameters and gradient); 0 at other stages or when unknown."""
    cpu_per_node: int
    """Host memory of one node: its ranks' offloaded state."""
    nvme_per_node: int
    """NVMe bytes of one node: its ranks' state offloaded to NVMe."""

    @property
    def per_gpu(self) -> int:
        return self.gpu.total + self.gpu_working


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate for one model and cluster: a row per stage and offload option."""

    num_parameters: int
    largest_layer: int | None
    """Parameters of the largest layer, when known (stage 3's working set)."""
    gpus_per_node: int
    nodes: int
    dtype: str
    rows: tuple[EstimateRow, ...]

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def row(self, stage: int, offload: str = "none") -> EstimateRow:
        """The row of `stage` with `offload`.

        Raises:
            KeyError: When that combination was not estimated.
        """
        for row in self.rows:
            if row.stage == stage and row.offload == offload:
                return row
        raise KeyError(f"no estimate for stage {stage} with offload {offload!r}")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1 or value != int(value):
        raise ValueError(f"{name}: {value!r} is not allowed; expected a whole number >= 1")
    return int(value)


def _offload_row(
    stage: int, option: OffloadOption, n: int, w: int, gpus_per_node: int, c: int, state_bytes: int
) -> tuple[Predicted, int, int]:
    """GPU bytes, CPU bytes per node, NVMe bytes per node of one offload option at one stage."""
    if option.optimizer == "none":
        return (
            predict(n, w, stage, compute_bytes=c, grad_bytes=c, master_copy=c < 4, state_bytes=state_bytes),
            0,
            0,
        )
    gpu = Predicted(
        parameters=0 if option.param != "none" else (c * n // w if stage >= 3 else c * n),
        gradients=c * n if stage == 1 else 0,
        optimizer_state=0,
    )
    master = 4 if c < 4 else 0
    optimizer_host = (state_bytes + master + FP32_GRAD_BYTES) * n // w * gpus_per_node
    param_host = c * n // w * gpus_per_node if option.param != "none" else 0
    cpu = (optimizer_host if option.optimizer == "cpu" else 0) + (param_host if option.param == "cpu" else 0)
    nvme = (optimizer_host if option.optimizer == "nvme" else 0) + (
        param_host if option.param == "nvme" else 0
    )
    return gpu, cpu, nvme


def estimate_memory(
    num_parameters: int | float,
    *,
    gpus_per_node: int = 1,
    nodes: int = 1,
    dtype: str = "bf16",
    largest_layer: int | float | None = None,
    offload: str | list[str] | tuple[str, ...] | None = None,
    stages: tuple[int, ...] = (0, 1, 2, 3),
    state_bytes: int = ADAM_STATE_BYTES,
    mics_shard_size: int = -1,
    hpz_partition_size: int = 1,
) -> MemoryEstimate:
    """Estimates model-state memory for every ZeRO stage and offload option.

    See [Note: estimator assumptions] for what is counted. `estimate_memory(7e9, gpus_per_node=8)
    .row(1).per_gpu` is 38.5e9, the ZeRO paper's stage-1 figure.

    Args:
        num_parameters: Trainable parameters N (a float such as 7e9 is accepted when whole).
        gpus_per_node: GPUs (ranks) per node.
        nodes: Nodes; the data-parallel world size is gpus_per_node * nodes.
        dtype: "bf16" or "fp16" (mixed precision: fp32 master copy and Adam states) or "fp32".
        largest_layer: Parameters of the largest layer, for stage 3's gathered working set; None leaves
            it out.
        offload: Names from `OFFLOAD_OPTIONS` to estimate (one name or several); None means all.
        stages: The ZeRO stages to estimate.
        state_bytes: Optimizer-state bytes per parameter besides the master copy (Adam: 8).
        mics_shard_size: Hybrid sharding's group size S (-1: off): state over S ranks, no offload rows.
        hpz_partition_size: ZeRO++ hpZ's group size H (1: off): stage 3 keeps c·N/H more per GPU, no
            offload rows.

    Returns:
        One row per supported (stage, offload) pair, stages in order, options in `OFFLOAD_OPTIONS` order.

    Raises:
        ValueError: When a count is not a whole number >= 1, or the dtype, an offload name or a stage is
            unknown.
    """
    n = _positive_int("num_parameters", num_parameters)
    per_node = _positive_int("gpus_per_node", gpus_per_node)
    node_count = _positive_int("nodes", nodes)
    layer = None if largest_layer is None else _positive_int("largest_layer", largest_layer)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not allowed; expected one of {', '.join(DTYPE_BYTES)}")
    names = _checked_names(offload, stages)
    c = DTYPE_BYTES[dtype]
    w = _sharded_over(mics_shard_size, per_node * node_count)
    hpz = _hpz_size(hpz_partition_size, mics_shard_size, per_node * node_count)
    rows = []
    for stage in sorted(set(stages)):
        for name in OFFLOAD_OPTIONS:
            option = OFFLOAD_OPTIONS[name]
            if (
                name not in names
                or stage not in option.stages
                or (name != "none" and (w < per_node * node_count or hpz))
            ):
                continue
            gpu, cpu, nvme = _offload_row(stage, option, n, w, per_node, c, state_bytes)
            if stage == 3 and hpz:  # the secondary shards: stage3/secondary.py [Note: hpZ secondary shards]
                gpu = dataclasses.replace(gpu, parameters=gpu.parameters + c * n // hpz)
            working = 2 * c * layer if stage == 3 and layer is not None else 0
            rows.append(EstimateRow(stage, name, gpu, working, cpu, nvme))
    return MemoryEstimate(n, layer, per_node, node_count, dtype, tuple(rows))


def _checked_names(offload: str | list[str] | tuple[str, ...] | None, stages: tuple[int, ...]) -> list[str]:
    """The offload options to estimate; refuse unknown names and stages."""
    names = (
        list(OFFLOAD_OPTIONS) if offload is None else [offload] if isinstance(offload, str) else list(offload)
    )
    unknown = [name for name in names if name not in OFFLOAD_OPTIONS]
    if unknown:
        raise ValueError(
            f"offload: {unknown[0]!r} is not allowed; expected one of {', '.join(OFFLOAD_OPTIONS)}"
        )
    bad_stages = [s for s in stages if s not in (0, 1, 2, 3)]
    if bad_stages:
        raise ValueError(f"stages: {bad_stages[0]!r} is not a ZeRO stage; expected 0, 1, 2 or 3")
    return names


def _sharded_over(mics_shard_size: int, world_size: int) -> int:
    """How many ranks the state is sharded over: the world, or hybrid sharding's group size."""
    check_shard_size(mics_shard_size, world_size)
    return world_size if mics_shard_size in (-1, 0) else mics_shard_size


def _hpz_size(hpz_partition_size: int, mics_shard_size: int, world_size: int) -> int:
    """hpZ's group size, or 0 where it is off (core/hybrid.py [Note: hpZ groups])."""
    check_hpz_size(hpz_partition_size, world_size)
    if not hpz_on(hpz_partition_size, world_size):
        return 0
    if mics_shard_size > 0:
        raise ValueError(
            f"hpz_partition_size: {hpz_partition_size} with mics_shard_size: {mics_shard_size} is not "
            "supported: use one or the other"
        )
    return hpz_partition_size


# -- parameter counts from a Hugging Face config ------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts read off a model's config."""

    num_parameters: int
    largest_layer: int
    """Parameters of the largest single module (usually the token embedding)."""
    family: str
    """Which formula was used: "gpt2" or "llama"."""


def _get(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    if default is not None:
        return default
    raise ValueError(f"the model config has none of {' / '.join(keys)}; the parameter count needs it")


def _gpt2_size(cfg: Mapping[str, Any]) -> ModelSize:
    # GPT-2: LayerNorms and Linear layers with biases; fused qkv; learned positions; tied LM head.
    h, layers, vocab = (
        _get(cfg, "n_embd", "hidden_size"),
        _get(cfg, "n_layer", "num_hidden_layers"),
        _get(cfg, "vocab_size"),
    )
    positions = _get(cfg, "n_positions", "max_position_embeddings")
    inner = _get(cfg, "n_inner", "intermediate_size", default=4 * h)
    block = 2 * (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
    embeddings = vocab * h + positions * h
    head = 0 if _get(cfg, "tie_word_embeddings", default=True) else vocab * h
    total = embeddings + layers * block + 2 * h + head
    return ModelSize(total, max(vocab * h, h * inner + inner, 3 * h * h + 3 * h), "gpt2")


def _llama_size(cfg: Mapping[str, Any]) -> ModelSize:
    # Llama-style: RMSNorms (one weight each), bias-free attention with grouped KV heads, gated MLP.
    h, layers, vocab = (
        _get(cfg, "hidden_size", "n_embd"),
        _get(cfg, "num_hidden_layers", "n_layer"),
        _get(cfg, "vocab_size"),
    )
    inner = _get(cfg, "intermediate_size", "n_inner")
    heads = _get(cfg, "num_attention_heads", "n_head", default=1)
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=h // heads)
    bias = bool(cfg.get("attention_bias", False))
    q_o = 2 * h * heads * head_dim
    k_v = 2 * h * kv_heads * head_dim
    attn_bias = (heads + 2 * kv_heads) * head_dim + h if bias else 0
    mlp = 3 * h * inner + (2 * inner + h if cfg.get("mlp_bias", False) else 0)
    block = q_o + k_v + attn_bias + mlp + 2 * h
    tied = bool(cfg.get("tie_word_embeddings", False))
    total = vocab * h * (1 if tied else 2) + layers * block + h
    return ModelSize(total, max(vocab * h, h * inner), "llama")


def model_size_from_hf_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> ModelSize:
    """Counts the parameters of a GPT-2 or Llama-style decoder from its Hugging Face `config.json`.

    Reads only the config (no download, no weights). GPT-2 keys: `n_embd`, `n_layer`, `n_positions`,
    `vocab_size`, `n_inner`. Llama-style keys (Llama, Mistral and kin): `hidden_size`, `num_hidden_layers`,
    `intermediate_size`, `vocab_size`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
    `tie_word_embeddings`, `attention_bias`, `mlp_bias`. GPT-2 small gives 124,439,808 and Llama-2-7B
    6,738,415,616, the published counts.

    Args:
        config: The config as a dict, or the path of its JSON file.

    Raises:
        ValueError: When the file is not JSON or a key the count needs is missing (the message names it).
    """
    if not isinstance(config, Mapping):
        path = Path(config)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read the model config {path}: {err}") from None
        if not isinstance(config, Mapping):
            raise ValueError(f"the model config {path} is not a JSON object")
    gpt2_style = config.get("model_type") == "gpt2" or ("n_embd" in config and "hidden_size" not in config)
    return _gpt2_size(config) if gpt2_style else _llama_size(config)
