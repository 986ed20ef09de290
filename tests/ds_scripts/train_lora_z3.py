"""A DeepSpeed-Chat-style LoRA fine-tune at ZeRO stage 3, written the way such scripts are.

The model is built under ``deepspeed.zero.Init``, so its weights are empty placeholders from the start. Its
linear layers are then swapped for a LoRA layer that takes the placeholder weight as it is and sizes its
low-rank matrices from ``weight.ds_shape`` (``weight.shape`` is ``(0,)`` by then); every base weight is
frozen and only the LoRA matrices train. Runs unchanged under DeepSpeed (``torchrun``) and under
``zeroshard launch``; rank 0 writes the per-step mean losses and which ``deepspeed`` ran to
``$DS_SCRIPTS_OUT/lora_z3.json`` (tests/test_deepspeed_lora.py compares the two).
"""

from __future__ import annotations

import json
import math
import os

import deepspeed
import torch
import torch.nn.functional as F
from common import MICRO, global_batch, my_rows
from torch import nn

VOCAB = 13
WIDTH = 9
STEPS = 5
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
    },
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_force_ds_cpu_optimizer": False,
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.query = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.up = nn.Linear(width, 2 * width + 1)
        self.down = nn.Linear(2 * width + 1, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.query(h)) * self.value(h)
        return h + self.down(F.gelu(self.up(h)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(WIDTH) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), labels.reshape(-1))


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trained low-rank update: ``x W^T + b + (alpha / r) * x A B``.

    Takes the original layer's weight and bias objects as they are: under ZeRO-3 the weight is a partitioned
    placeholder, so the layer's sizes come from its ``ds_shape``.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, r: int, alpha: float, zero3: bool):
        super().__init__()
        out_features, in_features = weight.ds_shape if zero3 else weight.shape
        self.weight = weight
        self.bias = bias
        self.lora_a = nn.Parameter(torch.empty(in_features, r))
        self.lora_b = nn.Parameter(torch.zeros(r, out_features))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_a @ self.lora_b) * self.scaling


def convert_to_lora(model: nn.Module, under: str, r: int, alpha: float, zero3: bool) -> int:
    """Replace every ``nn.Linear`` whose name starts with ``under`` by a :class:`LoRALinear`."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(under)]
    for name in names:
        parent, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        setattr(model.get_submodule(parent), child, LoRALinear(old.weight, old.bias, r, alpha, zero3))
    return len(names)


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    zero3 = CONFIG["zero_optimization"]["stage"] == 3
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG, enabled=zero3):
        model = TinyLM()
    if model.blocks[0].query.weight.shape != (0,):
        raise RuntimeError("zero.Init left the weights whole")
    torch.manual_seed(1)
    if convert_to_lora(model, "blocks.", r=3, alpha=6.0, zero3=zero3) != 8:
        raise RuntimeError("expected 8 linear layers under blocks.")
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=CONFIG)
    losses = []
    for step in range(STEPS):
        ids = my_rows(global_batch(step, (6,), ints=VOCAB), rank)
        loss = engine(ids, ids.roll(-1, dims=1))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        deepspeed.comm.all_reduce(mean)
        losses.append(mean.item() / world)
    if rank == 0 and os.environ.get("DS_SCRIPTS_OUT"):
        result = {"losses": losses, "deepspeed": deepspeed.__version__}
        with open(os.path.join(os.environ["DS_SCRIPTS_OUT"], "lora_z3.json"), "w") as f:
            json.dump(result, f)
    engine.destroy()
    # Every rank leaves together and the group is torn down before exit: a gloo group destroyed at
    # interpreter exit while a peer still holds its side can abort the process (torchrun then fails the run).
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
