"""Real DeepSpeed checkpoints for tests/test_deepspeed_checkpoints.py, and what DeepSpeed does after them.

Run under DeepSpeed (``python -m torch.distributed.run --standalone --nproc_per_node 2 ds_checkpoints.py
OUT [RESUME]``, DS_ACCELERATOR=cpu, gloo). For every case in ``CASES`` (stages 0-3) it trains ``BEFORE``
steps on fixed data, saves a checkpoint to ``OUT/<case>/ckpt``, trains ``AFTER`` more steps and writes the
global mean losses and the weights (at the save and at the end) to ``OUT/<case>/after.pt``. With
``RESUME`` (a directory holding ``<case>/ckpt`` checkpoints written by zeroshard in DeepSpeed's format),
it instead loads each of those into a fresh engine and writes ``OUT/<case>/resumed.pt``: the same
``AFTER`` steps as DeepSpeed takes from its own checkpoint.

The model, data and config are plain torch and JSON, shared with the zeroshard side of the test: rank r of
W takes rows ``[r*8/W, (r+1)*8/W)`` of each 8-row global batch, so every world size sees the same data.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

GLOBAL_ROWS = 8
BEFORE = 3
AFTER = 3
# (name, stage, precision): the fp32 cases are the ones compared at 1e-5.
CASES = [
    ("z0", 0, "fp32"),
    ("z1", 1, "fp32"),
    ("z2", 2, "fp32"),
    ("z3", 3, "fp32"),
    ("z0_bf16", 0, "bf16"),
    ("z1_bf16", 1, "bf16"),
    ("z3_bf16", 3, "bf16"),
    ("z2_groups", 2, "fp32"),  # two param groups (decay and no-decay, as Hugging Face's Trainer makes)
    ("z3_groups", 3, "fp32"),
]


class Net(nn.Module):
    """Odd sizes (padding), a tied weight, a frozen layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.lin1 = nn.Linear(7, 15)
        self.lin2 = nn.Linear(15, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.lin2(torch.tanh(self.lin1(h)))
        h = h + self.scale.to(h.dtype) * self.frozen(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, 11).float(), y.reshape(-1))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def model_parameters(name: str, model: nn.Module) -> list[Any]:
    """What the case passes to ``initialize(model_parameters=...)``: the trained parameters, or for the
    ``*_groups`` cases two param groups with their own learning rate and weight decay."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if not name.endswith("_groups"):
        return trained
    matrices = [p for p in trained if p.dim() > 1]
    vectors = [p for p in trained if p.dim() <= 1]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 1e-2}]


def rows(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of global batch ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 11, (GLOBAL_ROWS, 5), generator=g)
    y = torch.randint(0, 11, (GLOBAL_ROWS, 5), generator=g)
    n = GLOBAL_ROWS // world_size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def config(stage: int, precision: str, world_size: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_ROWS,
        "train_micro_batch_size_per_gpu": GLOBAL_ROWS // world_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": 2e-2,
                "betas": [0.9, 0.99],
                "eps": 1e-8,
                "weight_decay": 0.01,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 4},
        },
        "zero_optimization": {"stage": stage},
        "zero_force_ds_cpu_optimizer": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _mean_loss(loss: torch.Tensor) -> float:
    import torch.distributed as dist

    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _full_weights(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def _train(engine: Any, first: int, steps: int) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(first, first + steps):
        x, y = rows(step, rank, world)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(_mean_loss(loss))
    return losses


def _engine(name: str, stage: int, precision: str) -> Any:
    import deepspeed
    import torch.distributed as dist

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model_parameters(name, model),
        config=config(stage, precision, dist.get_world_size()),
    )
    return engine


def _read_scaler(resume: str, out: str) -> None:
    """The loss scaler zeroshard pickled into ``resume/fp16``, as DeepSpeed unpickles it (its class and
    fields), to ``out/fp16_scaler.pt``; DeepSpeed has no fp16 on CPU to run it."""
    import glob

    files = sorted(glob.glob(os.path.join(resume, "fp16", "*", "*zero_pp_rank_0_*optim_states.pt")))
    if not files:
        return
    scaler = torch.load(files[0], weights_only=False)["optimizer_state_dict"]["loss_scaler"]
    fields = {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool))}
    cls = type(scaler)
    torch.save(
        {"class": f"{cls.__module__}.{cls.__qualname__}", **fields}, os.path.join(out, "fp16_scaler.pt")
    )


def main(out: str, resume: str | None) -> None:
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    if resume is not None and dist.get_rank() == 0:
        _read_scaler(resume, out)
    for name, stage, precision in CASES:
        if resume is not None and not os.path.isdir(os.path.join(resume, name)):
            continue  # not written back (stage 0)
        case = os.path.join(out, name)
        os.makedirs(case, exist_ok=True)
        engine = _engine(name, stage, precision)
        note = ""
        if resume is None:
            before = _train(engine, 0, BEFORE)
            engine.save_checkpoint(os.path.join(case, "ckpt"), client_state={"note": "from deepspeed"})
            saved = _full_weights(engine, stage)
            result_name = "after.pt"
        else:
            path, client = engine.load_checkpoint(os.path.join(resume, name, "ckpt"))
            if path is None:
                raise RuntimeError(f"DeepSpeed loaded nothing from {resume}/{name}/ckpt")
            before, saved, note = [], {}, str((client or {}).get("note", ""))
            result_name = "resumed.pt"
        after = _train(engine, BEFORE, AFTER)
        weights = _full_weights(engine, stage)
        if dist.get_rank() == 0:
            result = {
                "before": torch.tensor(before, dtype=torch.float64),
                "after": torch.tensor(after, dtype=torch.float64),
                "global_steps": torch.tensor(engine.global_steps),
                "lr": torch.tensor(engine.get_lr()[0], dtype=torch.float64),
                "weights": weights,
                "saved_weights": saved,
                "note": note,
            }
            torch.save(result, os.path.join(case, result_name))
        dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
