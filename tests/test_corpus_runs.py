"""Acceptance: every shared DeepSpeed config that DeepSpeed accepts also trains with zeroshard (W = 2).

Each ACCEPT file of shared/ds-configs gets the Hugging Face "auto" filling (see test_config_corpus); the
test then sets every learning rate, warm-up bounds included, to ``LR`` (the filled 1e-4, a config's 1e-5
or a warm-up from 0 moves bf16 weights of this tiny model by less than one bf16 ulp in a few steps, so
nothing would show) and trains ``STEPS``
optimizer steps (all their accumulation micro-steps) of a tiny model, unchanged otherwise.

Both ranks get the same micro-batches. Then every loss must be the same on both ranks, bit for bit, and so
must the full parameters after training: each rank computes with the parameters the shards were gathered
into, so a shard reduced, stepped or gathered wrongly on one rank shows as a difference. And the loss on
the training batch must go down, measured before and after under ``no_grad``: the optimizer, scheduler,
precision and offload the config names really trained the model (fp16 steps skipped for an overflow
are allowed, as long as at least one step was taken).
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import VOCAB, make_model
from tests.test_config_corpus import CORPUS, VERDICTS, WORLD_SIZE, hf_fill

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not CORPUS.is_dir(), reason=f"acceptance corpus not found at {CORPUS} (shared/ is not checked out)"
    ),
]

STEPS = 4
LR = 1e-2


def _raise_rates(cfg: dict[str, Any]) -> dict[str, Any]:
    params = (cfg.get("optimizer") or {}).get("params")
    if isinstance(params, dict) and "lr" in params:
        params["lr"] = LR
    sched = (cfg.get("scheduler") or {}).get("params")
    if isinstance(sched, dict):
        for key in ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr"):
            if key in sched:
                sched[key] = LR
    return cfg


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _evaluate(engine: Any, data: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(engine(x, x)) for x in data) / len(data)


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        cfg = _raise_rates(hf_fill(json.loads((CORPUS / name).read_text())))
        model = make_model(0)
        kwargs: dict[str, Any] = {"model_parameters": model.parameters()}
        if "optimizer" not in cfg:
            kwargs = {"optimizer": torch.optim.AdamW(model.parameters(), lr=LR)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, _, _, _ = zeroshard.initialize(model=model, config=copy.deepcopy(cfg), **kwargs)
        micro = min(engine.train_micro_batch_size_per_gpu(), 8)  # a tiny model: the count changes nothing
        g = torch.Generator().manual_seed(0)  # the same micro-batches on both ranks
        data = [
            torch.randint(1, VOCAB, (micro, 5), generator=g)
            for _ in range(engine.gradient_accumulation_steps())
        ]

        before = _evaluate(engine, data)
        losses = []
        for _ in range(STEPS):
            for x in data:
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        assert engine.global_steps == STEPS, name
        out[name] = {
            "before": before,
            "after": _evaluate(engine, data),
            "losses": losses,
            "taken": engine.global_steps - engine.skipped_steps,
            "digest": _digest(engine.full_state_dict()),
        }
        engine.destroy()
    return out


@pytest.mark.timeout(600)
def test_every_accepted_config_trains_the_same_on_every_rank() -> None:
    names = sorted(n for n, (verdict, _) in VERDICTS.items() if verdict == "ACCEPT")
    assert len(names) == 36
    results = run_distributed(run_all, WORLD_SIZE, names, timeout=560)
    for name, r in results[0].items():
        other = results[1][name]
        assert r["losses"] == other["losses"], (name, r["losses"], other["losses"])
        assert r["digest"] == other["digest"], f"{name}: the ranks' parameters differ after training"
        assert all(loss == loss for loss in r["losses"]), (name, r["losses"])  # finite
        assert r["taken"] >= 1, f"{name}: every step was skipped"
        assert r["after"] < r["before"], f"{name}: loss {r['before']:.4f} -> {r['after']:.4f}"
