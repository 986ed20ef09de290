"""Stage 3, core/stage3/spent_units.py [Note: spent units]: a unit that no backward node reads any more is
released before its gradients arrive (a tied embedding after the LM head's backward), and only where that is
safe."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from tests.models import VOCAB, ToyLM, batch, make_model


class CustomHead(nn.Linear):
    """An LM head of a class of its own: the library cannot know what its backward reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class CustomEmbedding(nn.Embedding):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def _untied(embedding: type[nn.Embedding]) -> ToyLM:
    model = make_model(0)
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())
    custom = embedding(VOCAB, 7)
    custom.weight = model.emb.weight
    model.emb = custom
    return model


def _lean(stage3: dict[str, Any] | None = None) -> dict[str, Any]:
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
        **(stage3 or {}),
    }
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
    }


def _record(log: list[tuple[str, bool, bool]], release: Any, unit: Any) -> None:
    # Whether the unit was still gathered when its gradients were handed over, and whether its
    # parameters were the stand-ins (a broadcast: stride 0).
    standin = any(0 in p.data.stride() for p in unit.params if p.data.dim())
    log.append((unit.names[0], unit.gathered, standin))
    release(unit)


def _train(rank: int, model: ToyLM, retain_graph: bool = False) -> tuple[list[Any], list[Any], int]:
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_lean())
    log: list[tuple[str, bool, bool]] = []
    gatherer = engine.gatherer
    assert gatherer is not None
    gatherer.on_reduced = functools.partial(_record, log, gatherer.on_reduced)  # the reducer calls it
    for step in range(3):
        log.clear()
        engine.comm.stats.reset()
        x, y = batch(step, 0, rank)
        engine.backward(engine(x, y), retain_graph=retain_graph)
        engine.step()
    gathers = engine.comm.stats.calls_by_op["all_gather"]
    with engine.gathered_parameters():
        weights = [p.detach().tolist() for p in model.parameters()]  # plain lists cross the pipe
    return log, weights, gathers


def cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = make_model(0)
    custom = make_model(0)
    custom.head = CustomHead(7, VOCAB, bias=False)
    custom.head.weight = custom.emb.weight
    for name, model, retain in (("plain", plain, False), ("custom", custom, False), ("retain", None, True)):
        out[name] = _train(rank, model if model is not None else make_model(0), retain)
    out["untied"] = _train(rank, _untied(nn.Embedding))
    out["untied_custom"] = _train(rank, _untied(CustomEmbedding))
    return out


def test_spent_units_are_released_before_their_gradients_and_train_the_same() -> None:
    result = run_distributed(cases, 2)[0]
    tied = {name: [entry for entry in result[name][0] if entry[0] == "emb.weight"] for name in result}
    # nn.Embedding and nn.Linear: the tied unit is released after the head's backward, and its gradient is
    # laid out against a stand-in; it is not gathered again for the embedding's backward.
    assert tied["plain"] == [("emb.weight", False, True)], result["plain"][0]
    # A head of its own class, or a retained graph (autograd keeps the saved views): held until reduced.
    assert tied["custom"] == [("emb.weight", True, False)], result["custom"][0]
    assert tied["retain"] == [("emb.weight", True, False)], result["retain"][0]
    # Not gathered again for the embedding's backward: no all-gather more than when it is held.
    assert result["plain"][2] == result["custom"][2] == result["retain"][2], [r[2] for r in result.values()]
    # Releasing earlier changes nothing in what is computed: bit for bit the same weights.
    assert result["plain"][1] == result["custom"][1] == result["retain"][1]
    # An embedding of its own (untied): its backward saves nothing of the table, so it is not gathered for
    # the backward at all (one all-gather fewer per step), and its gradient lands on the stand-in.
    emb = {name: [e for e in result[name][0] if e[0] == "emb.weight"] for name in ("untied", "untied_custom")}
    assert emb["untied"] == [("emb.weight", False, True)], result["untied"][0]
    assert emb["untied_custom"] == [("emb.weight", True, False)], result["untied_custom"][0]
    assert result["untied"][2] == result["untied_custom"][2] - 1
    assert result["untied"][1] == result["untied_custom"][1]
