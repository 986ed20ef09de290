"""Acceptance: every shared DeepSpeed config that DeepSpeed accepts also trains with zeroshard (W = 2).

Each ACCEPT file of shared/ds-configs gets the Hugging Face "auto" filling (see test_config_corpus) and then
drives one optimizer step (all its accumulation micro-steps) of a tiny model, unchanged otherwise.
"""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import VOCAB, make_model
from tests.test_config_corpus import CORPUS, VERDICTS, WORLD_SIZE, hf_fill

pytestmark = pytest.mark.skipif(
    not CORPUS.is_dir(), reason=f"acceptance corpus not found at {CORPUS} (shared/ is not checked out)"
)


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, float]:
    out = {}
    for name in names:
        cfg = hf_fill(json.loads((CORPUS / name).read_text()))
        model = make_model(0)
        kwargs: dict[str, Any] = {"model_parameters": model.parameters()}
        if "optimizer" not in cfg:
            kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = zeroshard.initialize(model=model, config=copy.deepcopy(cfg), **kwargs)
        micro = engine.train_micro_batch_size_per_gpu()
        micro = min(micro, 8)  # the model is tiny; sample count does not change what is exercised
        g = torch.Generator().manual_seed(rank)
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randint(1, VOCAB, (micro, 5), generator=g)
            loss = engine(x, x)
            engine.backward(loss)
            engine.step()
        assert engine.global_steps == 1, name
        out[name] = float(loss.detach())
    return out


def test_every_accepted_config_trains() -> None:
    names = sorted(n for n, (verdict, _) in VERDICTS.items() if verdict == "ACCEPT")
    assert len(names) == 36
    results = run_distributed(run_all, WORLD_SIZE, names, timeout=420)
    for name, loss in results[0].items():
        assert loss == loss and loss < 10, (name, loss)  # finite
