"""DeepSpeedExamples' DCGAN loop on zeroshard takes DeepSpeed's own steps (issue 30, item 6).

tests/ds_scripts/train_gan_adam.py (client ``torch.optim.Adam`` optimizers, no ZeRO, DeepSpeed's default
gradient clipping, the discriminator's module in the generator's loss) runs under real DeepSpeed 0.19.8
(torchrun, CPU) and under ``zeroshard launch``, at world sizes 2 and 1, for 20 steps. The losses must agree
to 1e-6 relative at every step; on CPU they are equal to the bit. Before stage 0 computed its gradient
norm and clip factor in fp32 as DeepSpeed does ([Note: DeepSpeed's fp32 clipping] in
zeroshard/core/optimizer.py), the runs parted by 2e-7 within 3 steps and by 2e-5 (W=2) and 1e-2 (W=1)
at step 20, Adam amplifying one ulp of a clip factor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_deepspeed_checkpoints import _ds_env, _ds_python, _ds_reference_env, _real_deepspeed

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "ds_scripts" / "train_gan_adam.py"
CONFIG = ROOT / "tests" / "ds_scripts" / "gan_adam.json"
STEPS = 20
# Four launches at once (six processes, each about 10 s of start-up and import).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


def _launch(runner: str, world: int, out: Path) -> subprocess.Popen[str]:
    out.mkdir()
    env = {**(_ds_reference_env() if runner == "deepspeed" else _ds_env()), "DS_SCRIPTS_OUT": str(out)}
    if runner == "deepspeed":
        command = [_ds_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    else:
        command = [sys.executable, "-m", "zeroshard.cli", "launch", "--num_gpus"]
    args = [str(world), str(SCRIPT), "--deepspeed_config", str(CONFIG), "--steps", str(STEPS)]
    return subprocess.Popen(
        [*command, *args], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_dcgan_with_client_adam_takes_deepspeeds_steps(tmp_path: Path) -> None:
    why = _real_deepspeed()
    if why is not None:
        pytest.skip(why)
    runs = {
        (runner, world): _launch(runner, world, tmp_path / f"{runner}-{world}")
        for world in (2, 1)
        for runner in ("deepspeed", "zeroshard")
    }
    for (runner, world), proc in runs.items():
        log, _ = proc.communicate(timeout=360)
        assert proc.returncode == 0, f"{runner} at W={world}:\n{log[-6000:]}"
    for world in (2, 1):
        want = json.loads((tmp_path / f"deepspeed-{world}" / "gan_adam.json").read_text())
        got = json.loads((tmp_path / f"zeroshard-{world}" / "gan_adam.json").read_text())
        assert len(got) == len(want) == 3 * STEPS
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            what = ("errD_real", "errD_fake", "errG")[i % 3]
            assert abs(g - w) <= 1e-6 * abs(w), (
                f"W={world}, step {i // 3}, {what}: zeroshard {g!r}, DeepSpeed {w!r}"
            )
