"""Tiny models for tests: odd sizes (padding), tied weights, a frozen and an unused parameter, a parameter
used only for some samples (so some ranks produce no gradient for it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 11


class ToyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 7)
        self.lin1 = nn.Linear(7, 15)
        self.lin2 = nn.Linear(15, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.rare = nn.Linear(7, 7)  # used only for samples whose first token is 0
        self.unused = nn.Parameter(torch.randn(3))  # never used in forward
        self.head = nn.Linear(7, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.lin2(torch.tanh(self.lin1(h)))
        h = h + 0.5 * self.frozen(h)
        rows = (x[:, 0] == 0).nonzero().flatten()
        if rows.numel():
            h = h.index_add(0, rows, self.rare(h[rows]))
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def make_model(seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM()


def batch(
    step: int,
    micro: int,
    rank: int,
    micro_batch: int = 2,
    seq: int = 5,
    rare_at: Callable[[int, int, int], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic micro-batch; tokens avoid 0 unless ``rare_at(step, micro, rank)`` says otherwise."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randint(1, VOCAB, (micro_batch, seq), generator=g)
    y = torch.randint(0, VOCAB, (micro_batch, seq), generator=g)
    if rare_at is not None and rare_at(step, micro, rank):
        x[0, 0] = 0
    return x, y


def two_groups(model: ToyLM) -> list[dict[str, Any]]:
    first = list(model.lin1.parameters())
    ids = {id(p) for p in first}
    rest = [p for p in model.parameters() if id(p) not in ids and p.requires_grad]
    return [
        {"params": first, "lr": 1e-2, "weight_decay": 0.1},
        {"params": rest, "lr": 5e-3, "weight_decay": 0.01},
    ]


def tiny_llama(seed: int = 0) -> nn.Module:
    """A two-layer ``LlamaForCausalLM`` (vocabulary 64, width 32, grouped-query attention) built from a
    config, eager attention, no KV cache: what the Hugging Face tests train."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def sgd_reference(
    model: nn.Module,
    loss_of: Callable[[nn.Module, int, int], torch.Tensor],
    steps: int,
    world_size: int,
    lr: float = 0.1,
) -> nn.Module:
    """Train ``model`` in this one process the way ``world_size`` data-parallel ranks would with plain SGD:
    each step averages the gradients of ``loss_of(model, step, rank)`` over the ranks. Returns ``model``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad()
        for r in range(world_size):
            (loss_of(model, step, r) / world_size).backward()
        opt.step()
    return model


def assert_parameters_close(model: nn.Module, ref: nn.Module, case: str, tol: float) -> None:
    """Every parameter of ``model`` (full values: call inside a gather at stage 3) within ``tol`` relative
    (norm of the difference over norm of the reference) of ``ref``'s, in order, and finite."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not bool(torch.isfinite(p).all()):
            raise AssertionError(f"{case}: {name} is not finite")
        err = ((p - q).norm() / q.norm()).item()
        if err > tol:
            raise AssertionError(f"{case}: {name} {err:.2e} off (bound {tol:.0e})")
