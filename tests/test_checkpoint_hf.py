"""Hugging Face models: live exports and offline conversions load with ``from_pretrained``.

Tiny GPT-2 (tied embeddings) and Llama (untied) models built from a config: no download.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import transformers

import zeroshard
from tests.test_checkpoint import one_thread  # noqa: F401 (a fixture)
from zeroshard.checkpoint import convert_checkpoint, save_pretrained
from zeroshard.checkpoint.export import INDEX_NAME

VOCAB = 64


def _tiny(arch: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg: Any = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def _assert_same(loaded: torch.nn.Module, trained: dict[str, torch.Tensor], what: str) -> None:
    state = loaded.state_dict()
    assert state.keys() == trained.keys(), what
    for key, value in trained.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), f"{what}: {key}"


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_exports_load_with_from_pretrained(tmp_path: Any, arch: str) -> None:
    model = _tiny(arch)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}

    live = str(tmp_path / "live")
    files = save_pretrained(engine, live, max_shard_size=8_000)  # several files and an index
    assert len(files) > 1 and os.path.isfile(os.path.join(live, INDEX_NAME))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(live)
    _assert_same(loaded, trained, f"{arch} live export")
    if arch == "gpt2":  # tied weights stay tied: stored once, tied again by from_pretrained
        with open(os.path.join(live, INDEX_NAME)) as f:
            assert "lm_head.weight" not in json.load(f)["weight_map"]
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    ckpt = str(tmp_path / "ckpt")
    engine.save_checkpoint(ckpt)
    converted = str(tmp_path / "converted")
    convert_checkpoint(ckpt, converted, dtype="bf16")  # offline: config.json comes from the checkpoint
    loaded16 = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16)
    _assert_same(loaded16, trained, f"{arch} converted to bf16")
    with open(os.path.join(converted, "config.json")) as f:
        written = json.load(f)
    assert (
        written.get("dtype", written.get("torch_dtype")) == "bfloat16"
    )  # "torch_dtype" before transformers 5
