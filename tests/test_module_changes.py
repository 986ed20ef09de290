"""Models that DeepSpeed's ZeRO-3 hook tests exercise through its internals, trained by zeroshard at stage 3
(one process): a submodule behind an attribute-delegating wrapper trains as plain torch does, and a module
attached after ``initialize`` runs in the forward (untrained, as in DeepSpeed: it is in no optimizer)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard

pytestmark = pytest.mark.timeout(120)


class Delegating(nn.Module):
    """Forwards unknown attributes to the module it wraps (as PEFT's and many adapters' wrappers do)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.wrapped = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("wrapped"), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wrapped(x)
        return out


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.out = Delegating(nn.Linear(6, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.tanh(self.inp(x)))
        late = getattr(self, "late", None)  # attached after initialize by the test
        out: torch.Tensor = (late(h) if late is not None else h).pow(2).mean()
        return out


def test_delegating_wrapper_and_a_module_attached_after_initialize() -> None:
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed's default
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 0.0,
    }
    engine, *_ = zeroshard.initialize(model=model, config=config)
    wrapper: Any = engine.module.out
    assert wrapper.in_features == 6  # reached through the wrapper's __getattr__
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x))
        engine.step()
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with engine.gathered_parameters():
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
    late = nn.Linear(3, 3, bias=False)
    kept = late.weight.detach().clone()
    engine.module.late = late
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))
    loss = engine(x)
    with engine.gathered_parameters(), torch.no_grad():
        ref_loss = late(ref.out(torch.tanh(ref.inp(x)))).pow(2).mean()
    torch.testing.assert_close(loss.detach(), ref_loss)
    engine.backward(loss)
    engine.step()
    assert torch.equal(late.weight.detach(), kept)  # in no optimizer: not trained
    engine.destroy()
