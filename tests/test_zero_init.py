"""``zero.Init`` then ``GatheredParameters(..., modifier_rank=0)`` before ``initialize``, the way Hugging Face
fills a ZeRO-3 model (``from_pretrained`` loads the checkpoint on rank 0 inside the gather): rank 0's writes
reach every rank's shards, and training equals one process that loaded the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.models import tiny_llama

pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _reference(world_size: int) -> dict[str, torch.Tensor]:
    model = tiny_llama(seed=1)  # "the checkpoint": other values than the ones the ranks construct
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(world_size):
            ids = _ids(step, rank)
            (model(input_ids=ids, labels=ids).loss / world_size).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def worker(rank: int, world_size: int) -> list[str]:
    checkpoint = tiny_llama(seed=1).state_dict()
    ref = _reference(world_size)
    report = []
    for modify_after_initialize in (False, True):
        with zeroshard.zero.Init(config_dict_or_path=_config(3)):
            model = tiny_llama(seed=0)
        assert model.model.layers[0].mlp.up_proj.weight.numel() == 0, "Init did not partition"
        if not modify_after_initialize:
            with zeroshard.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if rank == 0:
                    model.load_state_dict(checkpoint)
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(3))
        if modify_after_initialize:
            with zeroshard.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if rank == 0:
                    model.load_state_dict(checkpoint)
        for step in range(STEPS):
            ids = _ids(step, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        with engine.gathered_parameters():
            worst = max(((p - ref[k]).norm() / ref[k].norm()).item() for k, p in model.named_parameters())
        if not worst <= 1e-5:
            raise AssertionError(
                f"rank {rank}, modify after initialize {modify_after_initialize}: {worst:.2e}"
            )
        report.append(f"{modify_after_initialize}: {worst:.1e}")
        engine.destroy()
    return report


def test_gathered_parameters_modifier_rank_fills_an_init_model() -> None:
    assert len(run_distributed(worker, 2)[0]) == 2


def test_init_takes_deepspeeds_arguments_and_refuses_others() -> None:
    """DeepSpeed's keyword arguments are accepted; one that asks for a missing feature names it; an unknown
    keyword is a TypeError, not silently swallowed."""
    with pytest.raises(TypeError, match="unexpected keyword"):
        zeroshard.zero.Init(config_dict_or_path={}, not_a_deepspeed_argument=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="mpu"):
        zeroshard.zero.Init(mpu=object())
    with pytest.raises(ValueError, match="quantized"):
        zeroshard.zero.Init(zero_quantized_weights=True)


_TORCH_APPLY = torch.nn.Module.apply


class _SelfInitialising(torch.nn.Module):
    """nanoGPT's pattern: submodules first, then ``self.apply(self._init_weights)`` at the end of
    ``__init__``, after zero.Init has already partitioned those submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        self.head = torch.nn.Linear(16, 50)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            torch.nn.init.zeros_(module.bias)
        elif isinstance(module, torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


def apply_worker(rank: int, world_size: int) -> float:
    torch.manual_seed(5)
    want = {k: v.detach().clone() for k, v in _SelfInitialising().named_parameters()}
    torch.manual_seed(5)
    with zeroshard.zero.Init():
        model = _SelfInitialising()
    assert model.head.weight.numel() == 0, "Init did not partition"
    with zeroshard.zero.GatheredParameters(list(model.parameters())):
        worst = max((p.detach() - want[k]).abs().max().item() for k, p in model.named_parameters())
    if worst != 0.0:
        raise AssertionError(f"rank {rank}: a model initialised in __init__ under Init differs by {worst}")
    # Outside Init, apply is torch's own again.
    assert torch.nn.Module.apply is _TORCH_APPLY
    return worst


def test_init_weights_applied_in_init_equal_one_process() -> None:
    assert run_distributed(apply_worker, 2) == [0.0, 0.0]
