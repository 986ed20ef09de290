"""Activation checkpointing trains exactly at every stage: ``torch.utils.checkpoint`` of both kinds around
hand-written blocks, and Hugging Face ``gradient_checkpointing_enable()`` on a tiny ``LlamaForCausalLM``.

Each case trains a few steps at W=2 and compares the weights with the same loop in one process without
zeroshard and without checkpointing (same global batch, fp32). At stage 3 the units are made small enough to
be sharded (``stage3_param_persistence_threshold`` 0), so a recomputation inside backward really re-enters
the gather hooks ([Note: recompute] in ``zeroshard/core/stage3/gatherer.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from tests.distributed import run_distributed
from tests.models import tiny_llama
from zeroshard.deepspeed import checkpointing as deepspeed_checkpointing

pytestmark = pytest.mark.timeout(400)

STEPS = 3
WORLD = 2
TOLERANCE = 1e-5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 13)
        self.b = nn.Linear(13, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(torch.tanh(self.a(h)))


class Blocks(nn.Module):
    """Three blocks and a head; ``reentrant`` None runs without checkpointing (the reference), "deepspeed"
    through ``deepspeed.checkpointing.checkpoint``."""

    def __init__(self, reentrant: bool | str | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.blocks:
            if self.reentrant is None:
                h = block(h)
            elif self.reentrant == "deepspeed":
                h = deepspeed_checkpointing.checkpoint(block, h)
            else:
                h = checkpoint(block, h, use_reentrant=self.reentrant)
        return F.cross_entropy(self.head(h), y)


class SharedBlock(Blocks):
    """One block applied three times (ALBERT-style weight sharing) after an input layer: with reentrant
    checkpointing each application's backward delivers a gradient of its own ([Note: repeated gradients]).
    Without the input layer (``embed=False``) nothing is left to arrive after the first region's backward."""

    def __init__(self, reentrant: bool | str | None, embed: bool = True) -> None:
        super().__init__(reentrant)
        block = Block()
        self.blocks = nn.ModuleList([block, block, block])
        self.embed = nn.Linear(8, 8) if embed else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embed(x), y)


def _llama(checkpointing: bool) -> nn.Module:
    model = tiny_llama(seed=0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _blocks(reentrant: bool | str | None) -> nn.Module:
    torch.manual_seed(0)
    return Blocks(reentrant)


def _data(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    if kind == "llama":
        ids = torch.randint(0, 64, (2, 12), generator=g)
        return ids, ids.clone()
    x = torch.randn(4, 8, generator=g)
    return x, torch.randint(0, 3, (4,), generator=g)


def _loss(kind: str, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "llama":
        return model(input_ids=x, labels=y).loss
    return model(x, y)


def _build(kind: str, variant: Any) -> nn.Module:
    if kind.startswith("shared"):
        torch.manual_seed(0)
        return SharedBlock(variant, embed=kind == "shared")
    return _llama(checkpointing=variant is not None) if kind == "llama" else _blocks(variant)


def _config(stage: int, offload_param: bool, persist: int = 0) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": persist}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


def _train_zeroshard(rank: int, case: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = _build(case["kind"], case["variant"])
    config = _config(case["stage"], case["offload"], case.get("persist", 0))
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(STEPS):
        x, y = _data(case["kind"], step, rank)
        if case["kind"] != "llama" and case["variant"] in (True, "deepspeed"):
            x.requires_grad_(True)  # reentrant checkpoint needs an input that requires grad
        loss = _loss(case["kind"], engine, x, y)
        engine.backward(loss)
        engine.step()
    with engine.gathered_parameters():
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
    engine.destroy()
    return state


def _train_reference(kind: str) -> dict[str, torch.Tensor]:
    model = _build(kind, None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            x, y = _data(kind, step, rank)
            (_loss(kind, model, x, y) / WORLD).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[str]:
    """Every case's relative error against the one-process reference, as text (rank 0 checks)."""
    references = {kind: _train_reference(kind) for kind in {c["kind"] for c in cases}}
    out = []
    for case in cases:
        got = _train_zeroshard(rank, case)
        ref = references[case["kind"]]
        worst = max(((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() for k in ref)
        out.append(f"{case}: {worst:.2e}")
        if not worst <= TOLERANCE:
            raise AssertionError(f"rank {rank}: {case} differs from one-process training by {worst:.2e}")
    return out


def test_torch_and_hf_checkpointing_every_stage() -> None:
    """One spawn for both: ``torch.utils.checkpoint`` of both kinds (and DeepSpeed's) around hand-written
    blocks at every stage, and Hugging Face ``gradient_checkpointing_enable()`` on the tiny Llama."""
    cases = [
        {"kind": "blocks", "variant": reentrant, "stage": stage, "offload": False}
        for stage in (0, 1, 2, 3)
        for reentrant in (False, True, "deepspeed")
    ]
    cases += [{"kind": "blocks", "variant": r, "stage": 3, "offload": True} for r in (False, True)]
    cases += [{"kind": "llama", "variant": True, "stage": stage, "offload": False} for stage in (2, 3)]
    cases.append({"kind": "llama", "variant": True, "stage": 3, "offload": True})
    report = run_distributed(worker, WORLD, cases, timeout=380)[0]
    assert len(report) == len(cases)


def shared_worker(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[str]:
    """Like ``worker``; a case with ``raises`` must fail with that text in a RuntimeError instead."""
    references = {kind: _train_reference(kind) for kind in {c["kind"] for c in cases}}
    out = []
    for case in cases:
        try:
            got = _train_zeroshard(rank, case)
        except RuntimeError as error:
            if case.get("raises") and case["raises"] in str(error):
                out.append(f"{case}: raised")
                continue
            raise
        if case.get("raises"):
            raise AssertionError(f"rank {rank}: {case} trained instead of raising")
        ref = references[case["kind"]]
        worst = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
        out.append(f"{case}: {worst:.2e}")
        if not worst <= TOLERANCE:
            raise AssertionError(f"rank {rank}: {case} differs from one-process training by {worst:.2e}")
    return out


def test_shared_module_under_reentrant_checkpointing() -> None:
    """A block used three times, each use in a reentrant checkpoint region, gets three gradients per
    backward ([Note: repeated gradients]). Where they all reach the unit before its reduction (stages 0-2
    with the input layer in the same unit, arriving last; stage 3 with the model kept whole) they are summed
    and training matches one process. Where the unit went to its reduction in between (stage 3 sharded: the
    block is recomputed after its unit was released; stage 0 without the input layer: the last parameter
    arrived in the first region) a named error says what to change, on both ranks, instead of a crash or a
    dropped gradient. Non-reentrant checkpointing of the same model trains exactly at stage 3."""
    shared = {"kind": "shared", "offload": False}
    cases: list[dict[str, Any]] = [{**shared, "variant": True, "stage": stage} for stage in (0, 1, 2)]
    cases.append({**shared, "variant": "deepspeed", "stage": 2})
    cases.append({**shared, "variant": True, "stage": 3, "persist": 10**6})
    cases.append({**shared, "variant": False, "stage": 3})
    cases.append({**shared, "variant": True, "stage": 3, "raises": "Linear ran again"})
    cases.append({**shared, "kind": "shared-only", "variant": True, "stage": 0, "raises": "second gradient"})
    for report in run_distributed(shared_worker, WORLD, cases, timeout=200):
        assert [line.endswith("raised") for line in report] == [bool(c.get("raises")) for c in cases]


def test_configure_refuses_contiguous_checkpointing_without_num_checkpoints() -> None:
    """DeepSpeed asserts that contiguous checkpointing names how many layers it checkpoints; so does
    zeroshard (an ``ArgumentError``, also an ``AssertionError``), though it keeps no contiguous buffers."""
    with pytest.raises(ValueError, match="needs num_checkpoints") as info:
        deepspeed_checkpointing.configure(None, contiguous_checkpointing=True)
    assert isinstance(info.value, AssertionError)
    deepspeed_checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=4)
    assert deepspeed_checkpointing.is_configured()
    deepspeed_checkpointing.reset()
