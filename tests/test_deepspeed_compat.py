"""Unchanged DeepSpeed code on zeroshard (#17): the `import deepspeed` alias as installed by pip (editable
and wheel), a real DeepSpeed left alone unless asked, and DeepSpeed-style scripts (tests/ds_scripts) at
world size 2 under `zeroshard launch` and under `ZEROSHARD_AS_DEEPSPEED=1 torchrun`, whose losses equal
the same loops in plain PyTorch in one process.

The installs go into virtual environments made in a temporary directory that see this interpreter's
packages (torch, transformers) through a path file; making one and `pip install --no-deps -e .` into it
takes a couple of seconds. A directory holding a `deepspeed` package on PYTHONPATH stands in for a real
DeepSpeed installation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent / "ds_scripts"))
from common import MICRO, WORLD, global_batch, mlp, regression_batch, tiny_llama

from zeroshard.lr_schedules import WarmupDecayLR, WarmupLR

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "ds_scripts"
# pip installs into fresh virtual environments, `zeroshard launch` and torchrun: integration (`make test-unit`
# leaves them out).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _venv(path: Path, *install: str) -> Path:
    """A venv at ``path`` that sees this interpreter's packages, with ``install`` pip-installed (no deps)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "_parent_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *install]
    subprocess.run(pip, check=True, cwd=ROOT, env=_clean_env())
    return python


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


@pytest.fixture(scope="module")
def editable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory.mktemp("venv-editable"), "-e", ".")


PROBE = """
import importlib.metadata, importlib.util, sys
import deepspeed
print(getattr(deepspeed, "REAL", False), importlib.util.find_spec("deepspeed") is not None, end=" ")
if not getattr(deepspeed, "REAL", False):
    import deepspeed.comm, zeroshard.deepspeed.comm
    assert deepspeed.comm is zeroshard.deepspeed.comm
    assert deepspeed.comm.__spec__.name == "zeroshard.deepspeed.comm"
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    # A module with no file in the tree, made from the inventory the package carries.
    import deepspeed.runtime.zero.stage3 as stage3
    assert stage3.Init is deepspeed.zero.Init
    assert stage3.__spec__.name == "zeroshard.deepspeed.runtime.zero.stage3"
    print(importlib.metadata.version("deepspeed") == deepspeed.__version__, deepspeed.__version__)
else:
    print()
"""


def _probe(python: Path, tmp_path: Path, alias: bool, fake_real: bool) -> tuple[str, str]:
    env = _clean_env(**({"ZEROSHARD_AS_DEEPSPEED": "1"} if alias else {}))
    if fake_real:
        (tmp_path / "site" / "deepspeed").mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / "deepspeed" / "__init__.py").write_text("REAL = True\n")
        env["PYTHONPATH"] = str(tmp_path / "site")
    done = subprocess.run(
        [python, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def test_alias_from_the_installed_pth_and_a_real_deepspeed_left_alone(editable: Path, tmp_path: Path) -> None:
    # Editable install (what CI uses): the variable makes `import deepspeed` give zeroshard's tree, with
    # the metadata transformers and accelerate check; a real DeepSpeed (the stand-in) is shadowed only
    # then, with one warning line.
    # Without the variable, `import deepspeed` finds a real DeepSpeed only where one is installed (the dev
    # extra installs 0.19.8 for tests/test_deepspeed_checkpoints.py); the alias then shadows it, saying so.
    done = subprocess.run(
        [editable, "-c", "import importlib.util; print(importlib.util.find_spec('deepspeed'))"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
    )
    real_installed = done.stdout.strip() != "None"
    out, err = _probe(editable, tmp_path, alias=True, fake_real=False)
    assert out.startswith("False True True 0.19.0+zeroshard.")
    assert ("is not used" in err) == real_installed, err
    out, err = _probe(editable, tmp_path, alias=False, fake_real=True)
    assert out == "True True" and err == ""
    out, err = _probe(editable, tmp_path, alias=True, fake_real=True)
    assert out.startswith("False True True")
    assert err.count("the DeepSpeed installed at") == 1 and str(tmp_path / "site") in err
    # Without the variable and without a real one, there is no deepspeed at all.
    if not real_installed:
        assert done.stdout.strip() == "None"
    else:
        assert "zeroshard" not in done.stdout, done.stdout
    # A wheel install carries the .pth file too.
    wheels = tmp_path / "wheels"
    build = [
        editable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(wheels),
        ".",
    ]
    subprocess.run(build, check=True, cwd=ROOT, env=_clean_env())
    wheel_python = _venv(tmp_path / "venv-wheel", str(next(wheels.glob("zeroshard-*.whl"))))
    out, _ = _probe(wheel_python, tmp_path, alias=True, fake_real=False)
    assert out.startswith("False True True")


# -- the scripts, launched -----------------------------------------------------------------------------------


def _launch(command: list[str], out: Path, alias: bool) -> subprocess.Popen[str]:
    env = _clean_env(DS_SCRIPTS_OUT=str(out), **({"ZEROSHARD_AS_DEEPSPEED": "1"} if alias else {}))
    args = [str(SCRIPTS / "run_all.py"), "--deepspeed_config", str(SCRIPTS / "accel_comm.json")]
    return subprocess.Popen(
        [*command, *args], cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_deepspeed_style_scripts_match_plain_pytorch(editable: Path, tmp_path: Path) -> None:
    runs = {
        "zeroshard launch": ([editable, "-m", "zeroshard.cli", "launch", "--num_gpus", "2"], False),
        "torchrun": (
            [editable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
            True,
        ),
    }
    procs = {}
    for name, (command, alias) in runs.items():
        out = tmp_path / name.replace(" ", "_")
        out.mkdir()
        procs[name] = (out, _launch([str(c) for c in command], out, alias))
    for name, (_, proc) in procs.items():
        log, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"{name}:\n{log[-6000:]}"
    expected = {name: fn() for name, fn in REFERENCES.items()}
    for name, (out, _) in procs.items():
        for script, want in expected.items():
            got = json.loads((out / f"{script}.json").read_text())
            assert got == pytest.approx(want, rel=1e-5, abs=1e-5), f"{script} under {name}"


# -- the same loops in plain PyTorch, one process, the whole global batch (gradient_clipping 1.0: DeepSpeed
# 0.19's default, which the scripts leave as it is) ------------------------------------------------------


def _accel_comm() -> list[float]:
    model = mlp(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=0.01, warmup_num_steps=2, warmup_type="linear")
    losses = []
    for micro in range(3 * 2):
        x, y = regression_batch(micro)
        loss = nn.functional.mse_loss(model(x), y)
        (loss / 2).backward()
        losses.append(loss.item())
        if micro % 2 == 1:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    return losses


def _cpu_adam() -> list[float]:
    model = mlp(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    losses = []
    for step in range(4):
        x, y = regression_batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed 0.19's default gradient_clipping
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _gan() -> list[float]:
    gen, disc = mlp(seed=3, sizes=(5, 9, 6)), mlp(seed=4, sizes=(6, 11, 1))
    g_opt = torch.optim.Adam(gen.parameters(), lr=0.01, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(disc.parameters(), lr=0.01, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(WORLD * MICRO, 1), torch.zeros(WORLD * MICRO, 1)
    losses = []
    for step in range(3):
        real, noise = global_batch(step, (6,)) + 1.0, global_batch(100 + step, (5,))
        disc.zero_grad()
        d_real = bce(disc(real), ones)
        d_real.backward()
        fake = gen(noise)
        d_fake = bce(disc(fake.detach()), zeros)
        d_fake.backward()
        nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
        d_opt.step()
        gen.zero_grad()
        g_loss = bce(disc(fake), ones)
        g_loss.backward()
        nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        g_opt.step()
        losses += [d_real.item(), d_fake.item(), g_loss.item()]
    return losses


def _hf() -> list[float]:
    model = tiny_llama(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    sched = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_max_lr=0.01)
    losses = []
    for micro in range(3 * 2):
        ids = global_batch(micro, (9,), ints=61)
        loss = model(input_ids=ids, labels=ids).loss
        (loss / 2).backward()
        losses.append(loss.item())
        if micro % 2 == 1:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    return losses


REFERENCES: dict[str, Callable[[], list[float]]] = {
    "accel_comm": _accel_comm,
    "cpu_adam": _cpu_adam,
    "gan": _gan,
    "hf": _hf,
}
