"""Opt-in retention: ``save_checkpoint(..., keep_last=N)`` keeps the newest N checkpoints of the directory and
deletes the older ones, never the one ``latest`` names, and nothing that is not a checkpoint directory (a
symlink, a file, a directory without metadata). Without it every tag is kept, as DeepSpeed does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroshard


def _engine() -> zeroshard.ZeroshardEngine:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    return engine


def test_keep_last_deletes_only_old_checkpoints(tmp_path: Path) -> None:
    engine = _engine()
    outside = tmp_path / "outside"
    (outside / "global_step0").mkdir(parents=True)
    (outside / "global_step0" / "metadata.json").write_text("{}")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "notes").mkdir()  # not a checkpoint
    (root / "README").write_text("mine")
    os.symlink(outside / "global_step0", root / "linked")  # a symlink to a checkpoint elsewhere
    for tag in ("a", "b", "c"):
        engine.save_checkpoint(str(root), tag=tag)
    assert {p.name for p in root.iterdir()} >= {"a", "b", "c"}  # default: every tag kept
    engine.save_checkpoint(str(root), tag="d", keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["README", "c", "d", "latest", "linked", "notes"]
    assert (outside / "global_step0" / "metadata.json").exists()
    # A save that does not move `latest` keeps its target, even when it is the oldest.
    engine.save_checkpoint(str(root), tag="e", save_latest=False, keep_last=1)
    assert (root / "latest").read_text().strip() == "d"
    assert {"d", "e"} <= {p.name for p in root.iterdir()} and not (root / "c").exists()
    assert engine.load_checkpoint(str(root))[0] is not None
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="keep_last"):
            engine.save_checkpoint(str(root), tag="f", keep_last=bad)  # type: ignore[arg-type]
    engine.destroy()
