"""A small Lightning training run, launched by tests/test_integration_lightning.py under torchrun (W=2).

    python -m torch.distributed.run --standalone --nproc-per-node 2 lightning_train.py \
        --strategy deepspeed_stage_3 --out OUT [--resume-epoch 1] [--cpu-deepspeed]

Trains a tiny MLP (odd layer sizes, built in ``configure_model``: under ZeRO-3 inside ``deepspeed.zero.Init``)
with AdamW on fixed synthetic data, 2 micro-batches per optimizer step, 3 epochs of 2 steps, saving a
checkpoint at the end of every epoch through ``ModelCheckpoint``. Writes, to OUT:

* ``losses_rank{r}.json``: every micro-batch loss that rank computed, in order;
* ``weights.pt`` (rank 0): the final full state dict (gathered under ZeRO-3);
* ``summary.json`` (rank 0): Lightning's model summary (its class, total and trainable parameters, text);
* ``ckpt/epoch={e}.ckpt``: Lightning's checkpoints (a file for DDP, a directory for DeepSpeed strategies).

``LIGHTNING_PACKAGE=pytorch_lightning`` runs it on the standalone ``pytorch_lightning`` package.
With ``--resume-epoch E`` it resumes from ``--resume-dir/epoch=E.ckpt`` instead of starting fresh. With
``--validate-full-weights FILE`` it only runs ``trainer.validate`` (every training batch, per-rank losses
to ``losses_rank{r}.json``) from a single-file checkpoint under ``ZeroshardStrategy(stage=3,
load_full_weights=True)``.

``--cpu-deepspeed`` is what a CPU-only machine needs for Lightning's own ``deepspeed_*`` strategies, with
real DeepSpeed as with zeroshard: Lightning refuses them on any accelerator but CUDA
(``DeepSpeedStrategy.setup_environment``) and checks CUDA device indices against local ranks. It lets the CPU
accelerator through those two checks and changes nothing else; on a GPU machine the script runs unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# "lightning.pytorch" (the `lightning` package) or "pytorch_lightning" (the standalone one)
PACKAGE = os.environ.get("LIGHTNING_PACKAGE", "lightning.pytorch")
L = importlib.import_module(PACKAGE)
ModelCheckpoint, ModelSummary = L.callbacks.ModelCheckpoint, L.callbacks.ModelSummary

SIZES = (7, 15, 3, 1)
ROWS = 32  # 2 ranks x 4 micro-batches of 4 rows: one epoch = 2 optimizer steps of 2 micro-batches
EPOCHS = 3


class TinyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        torch.manual_seed(1234)
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(SIZES):
            layers += [nn.Linear(a, b), nn.Tanh()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.net is not None
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.losses.append(nn.functional.mse_loss(self(x), y).item())

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(ROWS, SIZES[0], generator=g)
        y = x[:, :3].sum(dim=1, keepdim=True).sin()
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def _allow_cpu_for_lightning_deepspeed() -> None:
    """Let Lightning's DeepSpeedStrategy run on the CPU accelerator (it accepts only CUDA)."""
    lightning_deepspeed = importlib.import_module(f"{PACKAGE}.strategies.deepspeed")
    CPUAccelerator = L.accelerators.CPUAccelerator

    lightning_deepspeed.CUDAAccelerator = (lightning_deepspeed.CUDAAccelerator, CPUAccelerator)  # type: ignore[assignment]
    # CPU devices have no index to check against the local rank
    lightning_deepspeed._validate_device_index_selection = lambda devices: None


def _full_state_dict(trainer: L.Trainer, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The full weights on every rank; under ZeRO-3 gathered with DeepSpeed's ``GatheredParameters``."""
    if getattr(trainer.strategy, "zero_stage_3", False):
        if type(trainer.strategy).__name__ == "ZeroshardStrategy":  # no `import deepspeed` alias
            import zeroshard.deepspeed as deepspeed
        else:
            import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class RecordSummary(ModelSummary):
    """Lightning's model summary callback, also writing what it reports to ``OUT/summary.json`` (rank 0)."""

    def __init__(self, out: Path) -> None:
        super().__init__(max_depth=2)
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        summary = self._summary(trainer, pl_module)
        if trainer.is_global_zero:
            report = {
                "type": type(summary).__name__,
                "total": summary.total_parameters,
                "trainable": summary.trainable_parameters,
                "text": str(summary),
            }
            (self.out / "summary.json").write_text(json.dumps(report))


def _validate(args: argparse.Namespace, model: TinyRegression) -> None:
    """``trainer.validate`` from one consolidated checkpoint file, loaded into ZeRO-3 shards."""
    from zeroshard.integrations.lightning import ZeroshardStrategy

    strategy = ZeroshardStrategy(stage=3, load_full_weights=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False
    )
    trainer.validate(model, ckpt_path=str(args.validate_full_weights))
    (args.out / f"losses_rank{trainer.global_rank}.json").write_text(json.dumps(model.losses))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--resume-dir", type=Path)
    parser.add_argument("--resume-epoch", type=int)
    parser.add_argument("--cpu-deepspeed", action="store_true")
    parser.add_argument("--validate-full-weights", type=Path, help="a single-file checkpoint to validate")
    args = parser.parse_args()
    if args.cpu_deepspeed:
        _allow_cpu_for_lightning_deepspeed()
    if args.strategy.startswith("zeroshard"):
        import zeroshard.integrations.lightning  # noqa: F401  (registers the zeroshard_* strategy names)

    L.seed_everything(0, workers=True)
    model = TinyRegression()
    if args.validate_full_weights is not None:
        _validate(args, model)
        return
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=args.strategy,
        max_epochs=EPOCHS,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        callbacks=[
            ModelCheckpoint(dirpath=args.out / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1),
            RecordSummary(args.out),
        ],
        deterministic=True,
    )
    ckpt_path = None
    if args.resume_epoch is not None:
        ckpt_path = str(args.resume_dir / f"epoch={args.resume_epoch}.ckpt")
    trainer.fit(model, ckpt_path=ckpt_path)

    rank = trainer.global_rank
    loaded = sys.modules.get("deepspeed")
    info = {
        "strategy": type(trainer.strategy).__name__,
        "deepspeed": None if loaded is None else loaded.__name__,  # the module `import deepspeed` gave
    }
    (args.out / f"losses_rank{rank}.json").write_text(json.dumps(model.losses))
    weights = _full_state_dict(trainer, model)
    if rank == 0:
        torch.save(weights, args.out / "weights.pt")
        (args.out / "info.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
