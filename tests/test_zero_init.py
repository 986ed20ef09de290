"""``zero.Init`` then ``GatheredParameters(..., modifier_rank=0)`` before ``initialize``, the way Hugging Face
fills a ZeRO-3 model (``from_pretrained`` loads the checkpoint on rank 0 inside the gather): rank 0's writes
reach every rank's shards, and training equals one process that loaded the same weights. And what DeepSpeed
code reads off the placeholders: DeepSpeed's ``ds_*`` attributes, with the values DeepSpeed 0.19.8 shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroshard
from tests.distributed import run_distributed
from tests.models import tiny_llama
from zeroshard.core.ds_attrs import ZeroParamStatus

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
    with pytest.raises(ValueError, match="zero_quantized_nontrainable_weights"):
        zeroshard.zero.Init(zero_quantized_nontrainable_weights=True)
    with pytest.raises(TypeError, match="module"):
        zeroshard.zero.Init(module=[torch.nn.Linear(2, 2)])  # type: ignore[arg-type]


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


# -- DeepSpeed's placeholder attributes --------------------------------------------------------------------
class _Block(nn.Module):
    """A parameter of its own beside a submodule's; records ``ds_status`` of its own parameter in forward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.seen: list[ZeroParamStatus] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.scale.ds_status)
        return self.lin(h) * self.scale


class _Net(nn.Module):
    """Odd sizes (padding at W=2), a frozen layer, and a parameter of the outermost module."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(7, 15)
        self.block = _Block(15)
        self.frozen = nn.Linear(15, 3)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.block(self.first(x))) * self.gain


# Observed from DeepSpeed 0.19.8 (CPU, gloo, fp32) for _Net built under zero.Init: name -> (ds_shape, ds_id
# counted from the model's first, partition_numel() at W=1 and at W=2). ds_tensor is 1-D, of the parameter's
# dtype, partition_numel() elements; rank r holds elements [r * n, (r + 1) * n). Unchanged by initialize in
# DeepSpeed. "gain" (the outermost module's own) DeepSpeed numbers last: it is cut when its constructor ends,
# zeroshard cuts it when the Init block ends.
DS_INIT = {
    "first.weight": ((15, 7), 0, 105, 53),
    "first.bias": ((15,), 1, 15, 8),
    "block.lin.weight": ((15, 15), 2, 225, 113),
    "block.lin.bias": ((15,), 3, 15, 8),
    "block.scale": ((15,), 4, 15, 8),
    "frozen.weight": ((3, 15), 5, 45, 23),
    "frozen.bias": ((3,), 6, 3, 2),
}
DS_GAIN_ID = 7


def _ds_config(threshold: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold},
    }


def _consistent(model: nn.Module, where: str) -> None:
    """ds_status AVAILABLE only where the parameter holds its full value."""
    for name, p in model.named_parameters():
        if p.ds_status == ZeroParamStatus.AVAILABLE and tuple(p.shape) != tuple(p.ds_shape):
            raise AssertionError(f"{where}: {name} says AVAILABLE with shape {tuple(p.shape)}")


def placeholder_worker(rank: int, world_size: int) -> list[str]:
    import zeroshard.deepspeed as deepspeed

    done = []
    torch.manual_seed(0)
    want = {n: p.detach().clone() for n, p in _Net().named_parameters()}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=_ds_config(0)):
        model = _Net()
    params = dict(model.named_parameters())
    base = params["first.weight"].ds_id

    # Right after zero.Init: placeholders with DeepSpeed's attributes and values.
    for name, (shape, offset, numel_w1, numel_w2) in DS_INIT.items():
        p, size = params[name], (numel_w1, numel_w2)[world_size - 1]
        assert p.shape == (0,) and p.ds_shape == shape and p.ds_numel == want[name].numel(), name
        assert p.ds_id == base + offset and p.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
        shard = p.ds_tensor
        assert type(shard) is torch.Tensor and shard.dim() == 1 and shard.dtype == p.dtype, name
        assert not shard.requires_grad and shard.numel() == size == p.partition_numel(), name
        flat = want[name].reshape(-1)[rank * size : (rank + 1) * size]
        assert torch.equal(shard[: flat.numel()], flat), f"{name}: ds_tensor is not this rank's slice"
    gain = params["gain"]
    assert gain.shape == (0,) and gain.ds_shape == (3,) and gain.ds_id == base + DS_GAIN_ID, "outermost's own"
    assert gain.ds_tensor.numel() == gain.partition_numel() == (3, 2)[world_size - 1]
    done.append("init")

    # GatheredParameters: AVAILABLE and full inside, placeholders again after; modifier_rank's writes reach
    # every rank's ds_tensor.
    partitioned = [params[n] for n in DS_INIT]
    with deepspeed.zero.GatheredParameters(partitioned):
        for name in DS_INIT:
            assert params[name].ds_status == ZeroParamStatus.AVAILABLE, name
            assert torch.equal(params[name].detach(), want[name]), name
    for name in DS_INIT:
        assert params[name].ds_status == ZeroParamStatus.NOT_AVAILABLE and params[name].shape == (0,), name
    bias = params["first.bias"]
    with deepspeed.zero.GatheredParameters([bias], modifier_rank=0):
        if rank == 0:
            bias.data.fill_(7.0)
    valid = min(bias.partition_numel(), 15 - rank * bias.partition_numel())
    assert torch.equal(bias.ds_tensor[:valid], torch.full((valid,), 7.0)), bias.ds_tensor
    done.append("gathered")

    # initialize: ids and shapes stay; ds_status follows the engine's gathers; ds_tensor is this rank's
    # piece of the engine's master shard, the pieces of all ranks adding up to the parameter.
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_ds_config(0),
        dist_init_required=False,
    )
    for name, (shape, offset, _, _) in DS_INIT.items():
        p = params[name]
        assert p.ds_id == base + offset and p.ds_shape == shape, name
        assert p.ds_tensor.numel() == p.partition_numel(), name
        held = torch.tensor(p.partition_numel())
        torch.distributed.all_reduce(held)
        whole = p.ds_numel * (1 if p.requires_grad else world_size)  # frozen: whole on every rank
        assert held.item() == whole, f"{name}: the ranks hold {held.item()} of {p.ds_numel}"
    gain = params["gain"]
    assert gain.ds_id == base + DS_GAIN_ID and gain.ds_shape == (3,), (gain.ds_id, base)
    for name in ("first.weight", "block.scale", "gain"):
        assert params[name].ds_status == ZeroParamStatus.NOT_AVAILABLE, name
    for name in ("frozen.weight", "frozen.bias"):  # zeroshard keeps frozen parameters whole
        p = params[name]
        assert p.ds_status == ZeroParamStatus.AVAILABLE and p.partition_numel() == p.ds_numel, name
    _consistent(model, "after initialize")
    done.append("initialize")

    # Forward: NOT_AVAILABLE while the module runs (DeepSpeed: AVAILABLE; [Note: DeepSpeed parameter
    # attributes] says why); a step changes the master shard, which ds_tensor is.
    before = [params[n].ds_tensor.clone() for n in DS_INIT if params[n].requires_grad]
    x = torch.randn(2, 7, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    assert model.block.seen == [ZeroParamStatus.NOT_AVAILABLE], model.block.seen
    after = [params[n].ds_tensor for n in DS_INIT if params[n].requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)), "ds_tensor went stale"
    _consistent(model, "after a step")
    with deepspeed.zero.GatheredParameters([bias]):
        assert bias.ds_status == ZeroParamStatus.AVAILABLE and bias.shape == (15,)
    assert bias.ds_status == ZeroParamStatus.NOT_AVAILABLE
    with engine.gathered_parameters():
        assert bias.shape == (15,) and bias.ds_status == ZeroParamStatus.NOT_AVAILABLE
    _consistent(model, "after engine.gathered_parameters()")
    engine.destroy()
    done.append("train")

    # A model built outside zero.Init gets the process's next ids at initialize, in parameter order.
    # Persistent parameters (below stage3_param_persistence_threshold) are full: AVAILABLE.
    torch.manual_seed(1)
    plain = nn.Linear(3, 5)
    last = max(p.ds_id for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=plain, config=_ds_config(100), dist_init_required=False)
    assert (plain.weight.ds_id, plain.bias.ds_id) == (last + 1, last + 2)
    assert plain.weight.ds_status == ZeroParamStatus.AVAILABLE and plain.weight.shape == (5, 3)
    _consistent(plain, "persistent")
    engine.destroy()
    done.append("outside Init")

    # zero.Init(module=...) partitions a model built outside it, its own parameters included.
    torch.manual_seed(2)
    built = nn.Linear(5, 3)
    whole = built.weight.detach().clone()
    deepspeed.zero.Init(module=built)
    assert built.weight.shape == (0,) and built.weight.ds_shape == (3, 5), built.weight.shape
    with deepspeed.zero.GatheredParameters([built.weight]):
        assert torch.equal(built.weight.detach(), whole)
    assert built.weight.ds_id == last + 3
    done.append("Init(module=...)")

    # A module built on its own inside the block (never attached) is cut when the block ends, as DeepSpeed
    # cuts it when its constructor ends; one built after the block is untouched.
    with deepspeed.zero.Init():
        lone = nn.Linear(6, 3)
    after = nn.Linear(6, 3)
    assert lone.weight.shape == (0,) and lone.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert (lone.weight.ds_id, lone.bias.ds_id) == (last + 5, last + 6)  # built.bias took last + 4
    assert not hasattr(after.weight, "ds_status") and after.weight.shape == (3, 6)
    with deepspeed.zero.GatheredParameters(lone.weight, modifier_rank=0):
        assert lone.weight.ds_status == ZeroParamStatus.AVAILABLE and lone.weight.shape == (3, 6)
    done.append("module on its own")
    return done


@pytest.mark.parametrize("world_size", [1, 2])
def test_init_placeholders_show_deepspeeds_attributes(world_size: int) -> None:
    assert (
        run_distributed(placeholder_worker, world_size)
        == [
            [
                "init",
                "gathered",
                "initialize",
                "train",
                "outside Init",
                "Init(module=...)",
                "module on its own",
            ]
        ]
        * world_size
    )


JOINS = """
import torch.distributed as dist
from zeroshard.zero import Init

assert not dist.is_initialized()
with Init():
    assert dist.is_initialized() and dist.get_world_size() == 1
print("joined")
"""


@pytest.mark.timeout(120)
def test_init_joins_the_launchers_process_group(tmp_path: Path) -> None:
    """As DeepSpeed's: ``zero.Init()`` before ``initialize`` joins the group the launcher variables describe
    (here one process), so the model is partitioned over it; without them it builds for world size 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED",)}
    # MASTER_PORT 0: the one process's store binds a free port (no port to race for).
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    done = subprocess.run(
        [sys.executable, "-c", JOINS], env=env, capture_output=True, text=True, timeout=100, cwd=tmp_path
    )
    assert done.returncode == 0 and "joined" in done.stdout, done.stderr[-2000:]
