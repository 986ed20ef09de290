"""Two engines in one process train like the same loop in plain PyTorch: a GAN in the shape of DeepSpeed's
DCGAN example (the discriminator's engine runs ``backward`` twice before one ``step``; the generator's loss
is backpropagated through the discriminator; ``netD.zero_grad()`` is called on the plain module, or not at
all), at stages 0-3. Gradients that reach an engine's parameters from another engine's backward stay in
``param.grad``, as PyTorch leaves them; ``engine.step()`` is ``optimizer.step(); optimizer.zero_grad()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.distributed import run_distributed

pytestmark = pytest.mark.timeout(300)

STEPS = 3
LR = 0.1


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 6))
    disc = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 1))
    return gen, disc


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randn(3, 4, generator=g)  # real samples, noise


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def _reference(world_size: int, clear_d: bool) -> dict[str, torch.Tensor]:
    gen, disc = _nets()
    opt_g = torch.optim.SGD(gen.parameters(), lr=LR)
    opt_d = torch.optim.SGD(disc.parameters(), lr=LR)
    for step in range(STEPS):
        batches = [_data(step, r) for r in range(world_size)]
        if clear_d:
            disc.zero_grad()
        for real, _ in batches:
            (_bce(disc(real), 1.0) / world_size).backward()
        fakes = [gen(noise) for _, noise in batches]
        for fake in fakes:
            (_bce(disc(fake.detach()), 0.0) / world_size).backward()
        opt_d.step()
        opt_d.zero_grad()  # engine.step() clears the gradients it stepped with
        gen.zero_grad()
        for fake in fakes:
            (_bce(disc(fake), 1.0) / world_size).backward()
        opt_g.step()
        opt_g.zero_grad()
    return {f"g.{k}": v.detach().clone() for k, v in gen.named_parameters()} | {
        f"d.{k}": v.detach().clone() for k, v in disc.named_parameters()
    }


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def worker(rank: int, world_size: int) -> list[str]:
    report = []
    for clear_d in (True, False):
        ref = _reference(world_size, clear_d)
        for stage in (0, 1, 2, 3):
            gen, disc = _nets()
            engine_g, *_ = zeroshard.initialize(
                model=gen, model_parameters=gen.parameters(), config=_config(stage)
            )
            engine_d, *_ = zeroshard.initialize(
                model=disc, model_parameters=disc.parameters(), config=_config(stage)
            )
            for step in range(STEPS):
                real, noise = _data(step, rank)
                if clear_d:
                    disc.zero_grad()  # the plain module, as the example does
                engine_d.backward(_bce(engine_d(real), 1.0))
                fake = engine_g(noise)
                engine_d.backward(_bce(engine_d(fake.detach()), 0.0))
                engine_d.step()
                gen.zero_grad()
                engine_g.backward(_bce(engine_d(fake), 1.0))
                engine_g.step()
            with engine_g.gathered_parameters(), engine_d.gathered_parameters():
                got = {f"g.{k}": v.detach().clone() for k, v in gen.named_parameters()} | {
                    f"d.{k}": v.detach().clone() for k, v in disc.named_parameters()
                }
            worst = max(((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
            case = f"stage {stage}, netD.zero_grad() {clear_d}"
            if not worst <= 1e-5:
                raise AssertionError(f"rank {rank}: {case}: {worst:.1e} from PyTorch")
            report.append(case)
            engine_g.destroy()
            engine_d.destroy()
    return report


def teacher_worker(rank: int, world_size: int) -> None:
    from tests.models import batch, make_model

    teacher, reference = make_model(seed=1), make_model(seed=1)
    student = make_model(seed=0)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine_t, *_ = zeroshard.initialize(
        model=teacher, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero}
    )
    engine_s, *_ = zeroshard.initialize(
        model=student,
        model_parameters=student.parameters(),
        config={**_config(3), "train_micro_batch_size_per_gpu": 2},
    )
    engine_t.eval()
    for step in range(2):
        x, y = batch(step, 0, rank)
        with torch.no_grad():
            target = engine_t(x, y)
        torch.testing.assert_close(target, reference(x, y), rtol=1e-6, atol=1e-7)
        assert not any(u.gathered for u in engine_t.units if u.plan.shard_parameters), "teacher stays sharded"
        engine_s.backward(engine_s(x, y) + 0.1 * target)
        engine_s.step()


def gan_and_teacher_worker(rank: int, world_size: int) -> list[str]:
    teacher_worker(rank, world_size)
    return worker(rank, world_size)


def test_gan_and_frozen_teacher_train_like_pytorch() -> None:
    """One spawn: the GAN's two engines at stages 0-3 (8 cases); and, for distillation / RLHF reference
    models, an engine with no optimizer running forward in eval() at stage 3 with its parameters sharded,
    next to a trained engine."""
    assert len(run_distributed(gan_and_teacher_worker, 2)[0]) == 8
