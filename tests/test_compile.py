"""``torch.compile`` at stages 0-3: ``torch.compile(model)`` before ``initialize`` and ``engine.compile()``
train exactly as eager PyTorch in one process, and the compiled graphs stop changing after the first two
steps (at stage 3 the gather/release hooks run eagerly between compiled pieces: a fixed number of graph
breaks per step, no recompilation; the first forward, which looks for parameters used outside their
module, runs eagerly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from tests.models import assert_parameters_close, sgd_reference

pytestmark = pytest.mark.timeout(600)

STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        h = h + self.mlp(h)
        return F.cross_entropy(self.head(h).reshape(-1, 16), y.reshape(-1))


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


def worker(rank: int, world_size: int, cases: list[tuple[int, str, str]]) -> list[str]:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = sgd_reference(Net(), lambda m, step, r: m(*_data(step, r)), STEPS, world_size)
    done = []
    for stage, how, backend in cases:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Net()
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        wrapped = torch.compile(model, backend=backend) if how == "torch.compile" else model
        engine, *_ = zeroshard.initialize(model=wrapped, model_parameters=model.parameters(), config=config)
        if how == "engine.compile":
            engine.compile(backend=backend)
            assert engine.is_compiled
        graphs = []
        for step in range(STEPS):
            engine.backward(engine(*_data(step, rank)))
            engine.step()
            graphs.append(counters["stats"]["unique_graphs"])
        case = f"stage {stage}, {how}, {backend}"
        # At stage 3 the first forward runs eagerly (it looks for parameters used outside their module).
        if graphs[-1] == 0 or (stage < 3 and graphs[0] == 0):
            raise AssertionError(f"rank {rank}: {case}: nothing was compiled: {graphs}")
        if len(set(graphs[2:])) != 1:
            raise AssertionError(f"rank {rank}: {case}: graphs still changing after step 2: {graphs}")
        with engine.gathered_parameters():
            assert_parameters_close(model, ref, f"rank {rank}: {case}", 1e-5)
        engine.destroy()
        done.append(f"{case}: graphs {graphs}")
    return done


def test_compiled_training_equals_eager_and_stops_recompiling() -> None:
    cases = [(stage, "torch.compile", "aot_eager") for stage in (0, 1, 2, 3)]
    assert len(run_distributed(worker, 2, cases)[0]) == len(cases)


# The default backend generates and compiles C++ with the system's compiler: a toolchain run end to end,
# the slowest case by far, out of the unit suite (`make test-unit`).
@pytest.mark.integration
def test_engine_compile_with_inductor_at_stage_3() -> None:
    cases = [(3, "engine.compile", "inductor")]
    assert len(run_distributed(worker, 2, cases)[0]) == len(cases)
