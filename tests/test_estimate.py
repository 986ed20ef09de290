"""The memory estimator: the ZeRO paper's numbers, offload rows, Hugging Face counts, and real runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from zeroshard.estimate import OFFLOAD_OPTIONS, estimate_memory, model_size_from_hf_config

GB = 10**9


def test_the_zero_papers_7b_example() -> None:
    # ZeRO paper, figure 1: 7.5B there; 7B here. Mixed-precision Adam, 8 GPUs.
    est = estimate_memory(7e9, gpus_per_node=8, nodes=1, dtype="bf16")
    assert [est.row(s).per_gpu for s in range(4)] == [112 * GB, int(38.5 * GB), int(26.25 * GB), 14 * GB]
    assert est.world_size == 8 and est.num_parameters == 7 * GB


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize(("gpus", "nodes"), [(1, 1), (4, 1), (8, 2), (3, 5)])
def test_no_offload_rows_follow_the_formulas(dtype: str, gpus: int, nodes: int) -> None:
    n, w = 12_000_000_000, gpus * nodes
    est = estimate_memory(n, gpus_per_node=gpus, nodes=nodes, dtype=dtype)
    if dtype == "fp32":
        expected = [16 * n, 8 * n + 8 * n / w, 4 * n + 12 * n / w, 16 * n / w]
    else:
        expected = [16 * n, 4 * n + 12 * n / w, 2 * n + 14 * n / w, 16 * n / w]
    for stage in range(4):
        row = est.row(stage)
        assert row.per_gpu == pytest.approx(expected[stage], abs=4)
        assert (row.cpu_per_node, row.nvme_per_node, row.gpu_working) == (0, 0, 0)


def test_offload_rows_move_state_to_the_host() -> None:
    n, w = 7 * GB, 8
    est = estimate_memory(n, gpus_per_node=4, nodes=2, dtype="bf16", largest_layer=1e8)
    # Every option appears only at the stages that support it.
    assert [(r.stage, r.offload) for r in est.rows] == [
        (s, name) for s in range(4) for name, opt in OFFLOAD_OPTIONS.items() if s in opt.stages
    ]
    # Optimizer offload: fp32 master + Adam moments + an fp32 gradient copy per rank, 16N/W; 4 ranks a node.
    row = est.row(2, "optimizer-cpu")
    assert (row.gpu.parameters, row.gpu.gradients, row.gpu.optimizer_state) == (2 * n, 0, 0)
    assert row.cpu_per_node == 4 * 16 * n // w and row.nvme_per_node == 0
    assert est.row(1, "optimizer-cpu").gpu.gradients == 2 * n  # stage 1 keeps the full gradient
    # Parameter offload adds the bf16 parameter shard (18N/W per rank); stage 3 gathers the largest layer.
    row = est.row(3, "optimizer+param-nvme")
    assert row.gpu.total == 0 and row.gpu_working == 4 * 10**8 and row.per_gpu == 4 * 10**8
    assert row.nvme_per_node == 4 * 18 * n // w and row.cpu_per_node == 0
    assert est.row(3).per_gpu == 16 * n // w + 4 * 10**8


def test_estimate_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="num_parameters: 0 is not allowed"):
        estimate_memory(0)
    with pytest.raises(ValueError, match=r"num_parameters: 1\.5 is not allowed"):
        estimate_memory(1.5)
    with pytest.raises(ValueError, match="dtype: 'int8' is not allowed; expected one of bf16, fp16, fp32"):
        estimate_memory(10, dtype="int8")
    with pytest.raises(ValueError, match="offload: 'gpu' is not allowed"):
        estimate_memory(10, offload=["none", "gpu"])
    with pytest.raises(ValueError, match="stages: 4 is not a ZeRO stage"):
        estimate_memory(10, stages=(4,))
    only = estimate_memory(10, offload="optimizer-cpu", stages=(2,))
    assert [(r.stage, r.offload) for r in only.rows] == [(2, "optimizer-cpu")]
    with pytest.raises(KeyError, match="no estimate for stage 0 with offload 'none'"):
        only.row(0)


GPT2_SMALL = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_positions": 1024}
LLAMA2_7B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "tie_word_embeddings": False,
}


def test_parameter_counts_from_hugging_face_configs(tmp_path: Path) -> None:
    # The published counts: GPT-2 small 124,439,808; Llama-2-7B 6,738,415,616.
    assert model_size_from_hf_config(GPT2_SMALL).num_parameters == 124_439_808
    size = model_size_from_hf_config(LLAMA2_7B)
    assert (size.num_parameters, size.largest_layer, size.family) == (6_738_415_616, 32000 * 4096, "llama")
    # Llama-3-8B: grouped KV heads (8 of 32), 128256-token vocabulary, untied head: 8,030,261,248.
    llama3 = {**LLAMA2_7B, "vocab_size": 128256, "intermediate_size": 14336, "num_key_value_heads": 8}
    assert model_size_from_hf_config(llama3).num_parameters == 8_030_261_248
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2_SMALL))
    assert model_size_from_hf_config(path).num_parameters == 124_439_808
    # A key the count needs is named; so is a file that is not JSON.
    with pytest.raises(ValueError, match="none of intermediate_size / n_inner"):
        model_size_from_hf_config({"hidden_size": 8, "num_hidden_layers": 2, "vocab_size": 10})
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the model config"):
        model_size_from_hf_config(path)


def test_gpt2_count_matches_a_torch_model() -> None:
    # The formula against a real module of the same shape (tiny, so it builds in milliseconds).
    cfg = {"model_type": "gpt2", "vocab_size": 97, "n_embd": 16, "n_layer": 3, "n_positions": 11}
    h, inner = 16, 64

    def block() -> list[nn.Module]:
        return [
            nn.LayerNorm(h),
            nn.Linear(h, 3 * h),
            nn.Linear(h, h),
            nn.LayerNorm(h),
            nn.Linear(h, inner),
            nn.Linear(inner, h),
        ]

    modules = [
        nn.Embedding(97, h),
        nn.Embedding(11, h),
        *(m for _ in range(3) for m in block()),
        nn.LayerNorm(h),
    ]
    assert model_size_from_hf_config(cfg).num_parameters == sum(
        p.numel() for m in modules for p in m.parameters()
    )


# -- against measured memory ---------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 127), nn.Tanh(), nn.Linear(127, 63), nn.Tanh(), nn.Linear(63, 7))


def measured_model_states(rank: int, world_size: int) -> list[dict[str, Any]]:
    out = []
    for stage in (0, 1, 2):
        model = _model()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 4000},
        }
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        engine.backward(engine(torch.randn(2, 64)).square().mean())
        engine.step()  # the optimizer state exists after the first step
        mb = engine.memory_breakdown()
        out.append(
            {
                "stage": stage,
                "n": mb.num_parameters,
                "model_states": mb.parameters + mb.gradients + mb.optimizer_state,
            }
        )
    return out


def test_estimate_matches_measured_memory_breakdown_within_ten_percent() -> None:
    results = run_distributed(measured_model_states, 2)
    n = sum(p.numel() for p in _model().parameters())
    est = estimate_memory(n, gpus_per_node=2, dtype="fp32", stages=(0, 1, 2), offload="none")
    for per_rank in results:
        for got in per_rank:
            assert got["n"] == n
            predicted = est.row(got["stage"]).per_gpu
            assert got["model_states"] == pytest.approx(predicted, rel=0.10), got
