"""A DeepSpeed-Chat-style LoRA script (tests/ds_scripts/train_lora_z3.py) runs unchanged on zeroshard: its
model is built under ``zero.Init`` at ZeRO stage 3, its LoRA layers are sized from the partitioned weights'
``ds_shape``, and its per-step losses at world size 2 (fp32) equal the same script's under the real
DeepSpeed 0.19.8 on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ds_scripts" / "train_lora_z3.py"
# Real DeepSpeed and `zeroshard launch` in subprocesses.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _env(out: Path, **extra: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK", "ZEROSHARD_AS_DEEPSPEED")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_SCRIPTS_OUT": str(out), **extra}


def test_lora_sized_from_ds_shape_trains_as_under_deepspeed(tmp_path: Path) -> None:
    runs = {
        # No alias: `import deepspeed` is the installed DeepSpeed, on CPU.
        "deepspeed": (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
            {"DS_ACCELERATOR": "cpu"},
        ),
        "zeroshard": ([sys.executable, "-m", "zeroshard.cli", "launch", "--num_gpus", "2"], {}),
    }
    procs = {}
    for name, (command, extra) in runs.items():
        out = tmp_path / name
        out.mkdir()
        proc = subprocess.Popen(
            [*command, str(SCRIPT)],
            cwd=out,
            env=_env(out, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs[name] = (out, proc)
    results = {}
    for name, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=500)
        assert proc.returncode == 0, f"{name}:\n{log[-6000:]}"
        results[name] = json.loads((out / "lora_z3.json").read_text())
    assert results["deepspeed"]["deepspeed"] == "0.19.8", results["deepspeed"]
    assert "zeroshard" in results["zeroshard"]["deepspeed"], results["zeroshard"]
    theirs, ours = results["deepspeed"]["losses"], results["zeroshard"]["losses"]
    assert len(ours) == len(theirs) == 5, (ours, theirs)
    assert ours[-1] < ours[0], f"LoRA did not train: {ours}"
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert abs(got - want) <= 1e-6 * abs(want), (
            f"step {step + 1}: {got} vs DeepSpeed's {want}\n{ours}\n{theirs}"
        )
