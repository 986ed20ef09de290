"""A DeepSpeed-Chat-shaped script for the names RLHF code calls (#30): a LoRA layer swapped in with
``recursive_getattr`` / ``recursive_setattr`` (``deepspeed.compression.helper``), optimizer groups through
``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`` and ``FusedAdam``, a
``RepeatingLoader`` over a ``DataLoader`` that it wraps around several times, and ``engine.offload_states()``
/ ``engine.reload_states()`` after every optimizer step at ZeRO stage 3, as an RLHF actor frees the GPU for
generation.

It trains the same model twice in one process, once offloading and once not, and rank 0 writes both
per-micro-step loss lists (the mean over ranks) to ``$DS_SCRIPTS_OUT/offload_states.json``. Runs
unchanged under real DeepSpeed (``torchrun --nproc_per_node 2``, ``DS_ACCELERATOR=cpu``) and under
``zeroshard launch --num_gpus 2`` (tests/test_deepspeed_semantics.py).
"""

from __future__ import annotations

import json
import os

import deepspeed
import torch
from deepspeed import get_accelerator
from deepspeed.compression.helper import recursive_getattr, recursive_setattr
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.utils import RepeatingLoader
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

MICRO, GAS, STEPS, ROWS = 4, 2, 4, 20  # 20 rows: 10 per rank, 2 full micro-batches per pass
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GAS,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


class LoRALinear(nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA in small: the linear plus a low-rank update. The base stays
    trainable (DeepSpeed-Chat without --only_optimize_lora): DeepSpeed 0.19.8's stage-3 offload_states
    fails on a model with frozen parameters (its parameter buffer map counts them, its buffer does not)."""

    def __init__(self, base: nn.Linear, dim: int = 2, scaling: float = 0.5) -> None:
        super().__init__()
        self.weight = nn.Parameter(base.weight.detach().clone())
        self.bias = nn.Parameter(base.bias.detach().clone())
        self.lora_right_weight = nn.Parameter(torch.randn(base.in_features, dim) * 0.3)
        self.lora_left_weight = nn.Parameter(torch.zeros(dim, base.out_features))
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = x @ self.lora_right_weight @ self.lora_left_weight
        return nn.functional.linear(x, self.weight, self.bias) + lora * self.scaling


def make_model() -> nn.Module:
    torch.manual_seed(7)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 9), nn.LayerNorm(9)))
    model.add_module("head", nn.Linear(9, 1))
    for name in ["body.2"]:  # convert_linear_layer_to_lora, by name
        recursive_setattr(model, name, LoRALinear(recursive_getattr(model, name)))
    assert isinstance(recursive_getattr(model, "body.2"), LoRALinear)
    return model


def param_groups(model: nn.Module) -> list[dict]:
    """get_optimizer_grouped_parameters: decay, LoRA and no-decay groups, named, empty ones dropped."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in trained if "bias" in n or "body.3" in n]
    lora = [p for n, p in trained if "lora" in n]
    decay = [p for n, p in trained if "lora" not in n and not ("bias" in n or "body.3" in n)]
    groups = [
        {"params": decay, "weight_decay": 0.1, "name": "decay"},
        {"params": lora, "weight_decay": 0.0, "lr": 2e-2, "name": "lora"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return split_params_into_different_moe_groups_for_optimizer([g for g in groups if g["params"]])


def loader(rank: int, world: int) -> RepeatingLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(ROWS, 7, generator=g)
    data = TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True).sin())
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
    return RepeatingLoader(DataLoader(data, batch_size=MICRO, sampler=sampler, drop_last=True))


def train(offload: bool) -> list[float]:
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    device = get_accelerator().current_device_name()
    model = make_model()
    groups = param_groups(model)
    optimizer = FusedAdam(groups, lr=1e-2, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    losses = []
    batches = loader(rank, world)
    for step in range(STEPS * GAS):
        x, y = (t.to(device) for t in next(batches))
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        if offload and step % GAS == GAS - 1:  # after each optimizer step, as an RLHF actor does
            if step == GAS - 1:
                engine.offload_states()
            else:
                engine.offload_states(
                    include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params],
                    device=OffloadDeviceEnum.cpu,
                    non_blocking=True,
                )
            engine.reload_states()
    engine.destroy()
    return losses


def main() -> None:
    deepspeed.init_distributed()
    plain, offloaded = train(offload=False), train(offload=True)
    out = os.environ.get("DS_SCRIPTS_OUT")
    if out and deepspeed.comm.get_rank() == 0:
        with open(os.path.join(out, "offload_states.json"), "w") as f:
            json.dump({"plain": plain, "offload": offloaded}, f)
    # Every rank leaves together and the group is torn down before exit: a gloo group destroyed at
    # interpreter exit while a peer still holds its side can abort the process (torchrun then fails the run).
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
