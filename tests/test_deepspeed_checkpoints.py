"""DeepSpeed ZeRO checkpoints in zeroshard and back (#19), against real DeepSpeed 0.19.8 on CPU.

One DeepSpeed run (tests/ds_scripts/ds_checkpoints.py, two gloo processes) trains the same tiny model at
stages 0-3 (fp32; bf16 at stages 0, 1 and 3; two param groups at stages 2 and 3), saves a checkpoint
after 3 steps, trains 3 more and records the losses and weights. zeroshard then resumes each checkpoint
at world sizes 1, 2 and 4, at the stage it was saved with (at W=2) and at another (at W=1 and W=4), and
must take the same next steps. The way back: zeroshard writes DeepSpeed's layout (`zeroshard convert
--to deepspeed`, `save_checkpoint(format="deepspeed")`) and a second DeepSpeed run resumes it, again
taking DeepSpeed's own next steps. Also: the offline readers and conversions, fp16's loss scaler both
ways, and pickles that would run code.

DeepSpeed comes from the interpreter $ZEROSHARD_TEST_DEEPSPEED_PYTHON (default: this one, where the dev
extra installs it); without a real DeepSpeed there the DeepSpeed-generated cases skip, naming why.

Tolerances: fp32 losses and weights <= 1e-5 relative (the runs differ only in reduction order, ~1e-7);
bf16 runs compute in bf16 with different kernels and cast points, so losses agree to 2e-2 and weights to
2e-2 of their largest magnitude.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroshard
from tests.distributed import run_distributed
from tests.ds_scripts import ds_checkpoints as ds
from zeroshard.checkpoint import CheckpointError, convert_to_zeroshard, get_fp32_state_dict, open_checkpoint
from zeroshard.checkpoint.common import param_shape
from zeroshard.checkpoint.export import _gather_from_masters

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "ds_scripts" / "ds_checkpoints.py"
# The DeepSpeed runs (one process start-up and import each, about 10 s) come on top of the spawned workers.
pytestmark = pytest.mark.timeout(600)
PRECISION = {name: precision for name, _, precision in ds.CASES}
ZERO_CASES = [case for case in ds.CASES if case[1] > 0]  # what the way back writes: ZeRO stages 1-3


def _ds_python() -> str:
    return os.environ.get("ZEROSHARD_TEST_DEEPSPEED_PYTHON", sys.executable)


def _ds_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_AS_DEEPSPEED"}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _ds_reference_env() -> dict[str, str]:
    """``_ds_env`` for a run of the real DeepSpeed: tests/ds_reference/sitecustomize.py destroys its
    process group at exit, as zeroshard does for its own runs."""
    env = _ds_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "ds_reference"), str(ROOT)])
    return env


def _real_deepspeed() -> str | None:
    """None when the interpreter imports a real DeepSpeed; otherwise why not."""
    probe = "import deepspeed, sys; sys.exit(0 if 'zeroshard' not in deepspeed.__file__ else 3)"
    done = subprocess.run(
        [_ds_python(), "-c", probe], env=_ds_env(), capture_output=True, text=True, timeout=120
    )
    if done.returncode == 0:
        return None
    return f"{_ds_python()} has no real deepspeed (install the dev extra): {done.stderr.strip()[-300:]}"


def run_deepspeed(out: Path, resume: Path | None = None) -> None:
    """tests/ds_scripts/ds_checkpoints.py under DeepSpeed, two gloo ranks on CPU."""
    args = [_ds_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args += [str(SCRIPT), str(out), *([str(resume)] if resume is not None else [])]
    done = subprocess.run(args, env=_ds_reference_env(), capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        raise AssertionError(
            f"DeepSpeed run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
        )


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = _real_deepspeed()
    if why is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("deepspeed")
    run_deepspeed(out)
    return out


def _result(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def masters(engine: zeroshard.ZeroshardEngine) -> dict[str, torch.Tensor]:
    """Every trained parameter's fp32 master, gathered (collective at stages 1-2)."""
    return {
        name: _gather_from_masters(engine, unit, i).reshape(param_shape(unit, i)).clone()
        for unit in engine.units
        for i, name in enumerate(unit.names)
    }


def _engine(name: str, stage: int, precision: str, world_size: int) -> zeroshard.ZeroshardEngine:
    model = ds.make_model()
    engine, *_ = zeroshard.initialize(
        model=model,
        model_parameters=ds.model_parameters(name, model),
        config=ds.config(stage, precision, world_size),
    )
    return engine


def _train(engine: zeroshard.ZeroshardEngine, rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(ds.BEFORE, ds.BEFORE + ds.AFTER):
        x, y = ds.rows(step, rank, world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    return losses


def resume_worker(rank: int, world_size: int, root: str, planted: str | None) -> dict[str, Any]:
    """Every DeepSpeed checkpoint resumed in zeroshard: the next steps' losses, masters and counters; a
    planted pickle refused on every rank."""
    out: dict[str, Any] = {}
    if planted is not None:
        engine = _engine("z1", 1, "fp32", world_size)
        with pytest.raises(CheckpointError, match=r"refused.*posix.system"):
            engine.load_checkpoint(planted)
    for name, stage, precision in ds.CASES:
        # At W=2 (as saved) the stage it was saved with, elsewhere another one: every move is covered.
        for zstage in [stage if world_size == 2 else stage % 3 + 1]:
            engine = _engine(name, zstage, precision, world_size)
            path, client = engine.load_checkpoint(os.path.join(root, name, "ckpt"))
            assert path is not None and path.endswith("global_step3"), path
            assert client == {"note": "from deepspeed"}, client
            assert engine.global_steps == ds.BEFORE and engine.global_samples == ds.BEFORE * ds.GLOBAL_ROWS
            losses = _train(engine, rank, world_size)
            out[f"{name}@{zstage}"] = {
                "losses": losses,
                "masters": {k: v.tolist() for k, v in masters(engine).items()},  # no tensors across the queue
                "lr": engine.get_lr()[0],
                "steps": engine.global_steps,
            }
    return out


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    err = float((got.double() - want.double()).abs().max())
    scale = float(want.double().abs().max())
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.integration
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_deepspeed_checkpoint_resumes_in_zeroshard(ds_dir: Path, tmp_path: Path, world_size: int) -> None:
    """At W=2 and W=4 from DeepSpeed's directories; at W=1 from their copies that `zeroshard convert --to
    zeroshard` rewrote in zeroshard's own format."""
    from zeroshard.checkpoint.verify import verify_checkpoint
    from zeroshard.cli.convert import main as convert_main

    source = ds_dir
    if world_size == 1:
        source = tmp_path / "zeroshard-format"
        for name, _, _ in ds.CASES:
            out = source / name / "ckpt"
            assert convert_main([str(ds_dir / name / "ckpt"), str(out), "--to", "zeroshard"]) == 0
            assert verify_checkpoint(out).parameters == 5
    planted = _plant(tmp_path / "planted", "model") if world_size == 2 else None
    results = run_distributed(resume_worker, world_size, str(source), planted and str(planted))[0]
    if planted is not None:
        assert not (tmp_path / "planted" / "pwned").exists()
    for key, got in results.items():
        name = key.split("@")[0]
        want = _result(ds_dir / name / "after.pt")
        rel = 1e-5 if PRECISION[name] == "fp32" else 2e-2
        _close(torch.tensor(got["losses"]), want["after"], rel, f"{key} W={world_size} losses")
        for pname, value in got["masters"].items():
            _close(torch.tensor(value), want["weights"][pname], rel, f"{key} W={world_size} {pname}")
        assert got["steps"] == int(want["global_steps"])
        assert got["lr"] == pytest.approx(float(want["lr"]), rel=1e-12)


@pytest.mark.integration
def test_deepspeed_checkpoint_offline(ds_dir: Path, tmp_path: Path) -> None:
    """get_fp32_state_dict and `zeroshard convert` read DeepSpeed's fp32 masters, tied names included."""
    from safetensors.torch import load_file

    from zeroshard.checkpoint.verify import verify_checkpoint
    from zeroshard.cli.convert import main as convert_main

    for name, _, precision in ds.CASES:
        assert verify_checkpoint(ds_dir / name / "ckpt").parameters == 5  # every file opens, is allowed
        want = _result(ds_dir / name / "after.pt")["saved_weights"]
        state = get_fp32_state_dict(ds_dir / name / "ckpt")
        one = get_fp32_state_dict(ds_dir / name / "ckpt" / "global_step3")  # a tag's directory itself
        assert all(torch.equal(one[k], v) for k, v in state.items())
        assert state["head.weight"] is state["emb.weight"]
        assert state["frozen.weight"].shape == (7, 7) and "scale" in state
        for pname, value in want.items():
            if precision == "fp32":
                assert torch.equal(state[pname], value), pname
            else:  # DeepSpeed's module holds bf16 copies of the fp32 masters
                assert torch.equal(state[pname].to(torch.bfloat16).float(), value), pname
        out = tmp_path / name
        assert convert_main([str(ds_dir / name / "ckpt"), str(out)]) == 0
        written = load_file(str(out / "model.safetensors"))
        model = ds.make_model()
        model.load_state_dict(written, strict=False)
        for pname, value in state.items():
            assert torch.equal(model.state_dict()[pname].float(), value.float()), pname
    assert convert_main([str(ds_dir / "z1" / "ckpt"), str(tmp_path / "x"), "--world-size", "2"]) == 2
    with pytest.raises(CheckpointError, match="already a zeroshard checkpoint"):
        convert_to_zeroshard(_zeroshard_copy(ds_dir, tmp_path), tmp_path / "y")


def _zeroshard_copy(ds_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "z1-zeroshard"
    convert_to_zeroshard(ds_dir / "z1" / "ckpt", out)
    return out


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant(root: Path, where: str) -> Path:
    """A DeepSpeed-looking checkpoint in ``root/ckpt`` whose ``where`` file would, if unpickled, create
    ``root/pwned``."""
    ckpt = root / "ckpt"
    step = ckpt / "global_step1"
    step.mkdir(parents=True)
    (ckpt / "latest").write_text("global_step1")
    marker = root / "pwned"
    bad = {"module": {}, "payload": _Planted(str(marker))}
    good_model = {"module": {"w": torch.zeros(3)}, "param_shapes": [{"w": torch.Size([3])}]}
    good_optim = {
        "optimizer_state_dict": {"zero_stage": 1, "single_partition_of_fp32_groups": [torch.zeros(3)]}
    }
    torch.save(bad if where == "model" else good_model, step / "mp_rank_00_model_states.pt")
    torch.save(
        {"optimizer_state_dict": bad} if where == "optim" else good_optim,
        step / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    )
    return ckpt


@pytest.mark.parametrize("where", ["model", "optim"])
def test_pickle_that_would_run_code_is_refused(tmp_path: Path, where: str) -> None:
    """Offline here; engine.load_checkpoint at W=2 in test_deepspeed_checkpoint_resumes_in_zeroshard."""
    ckpt = _plant(tmp_path, where)
    with pytest.raises(CheckpointError, match=r"refused.*posix.system"):
        open_checkpoint(ckpt)
    assert not (tmp_path / "pwned").exists()


def save_worker(rank: int, world_size: int, root: str, out: str, direct: bool) -> None:
    """DeepSpeed's checkpoints loaded into zeroshard and saved again: at W=4 at another stage in
    zeroshard's format, or (``direct``) at W=2 at the same stage with ``format="deepspeed"``."""
    for name, stage, precision in ZERO_CASES:
        if (name in DIRECT) != direct:
            continue
        engine = _engine(name, stage if direct else 3 if stage != 3 else 2, precision, world_size)
        engine.load_checkpoint(os.path.join(root, name, "ckpt"))
        where = os.path.join(out, name, "ckpt") if direct else os.path.join(out, name)
        kind = "deepspeed" if direct else "zeroshard"
        engine.save_checkpoint(where, client_state={"note": "from zeroshard"}, format=kind)
    if direct:
        fp16_round_trip(rank, world_size, out)


def fp16_round_trip(rank: int, world_size: int, out: str) -> None:
    """An fp16 run's dynamic loss scaler, masters and moments through DeepSpeed's layout and back (DeepSpeed
    itself has no fp16 on CPU; the DeepSpeed run only unpickles the scaler written here)."""
    cfg = ds.config(2, "fp16", world_size)
    cfg["fp16"].update(loss_scale_window=2, hysteresis=1)  # the scale moves within 3 steps
    model = ds.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = zeroshard.initialize(model=model, model_parameters=params, config=cfg)
    _train(engine, rank, world_size)
    assert engine.loss_scaler is not None and engine.loss_scaler.scale != 2.0**8
    engine.save_checkpoint(os.path.join(out, "fp16"), format="deepspeed")
    model = ds.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    again, *_ = zeroshard.initialize(model=model, model_parameters=params, config=cfg)
    again.load_checkpoint(os.path.join(out, "fp16"))
    assert again.loss_scaler is not None
    assert again.loss_scaler.state_dict() == engine.loss_scaler.state_dict()
    for (name, a), b in zip(masters(again).items(), masters(engine).values(), strict=True):
        assert torch.equal(a, b), name
    assert again.global_steps == engine.global_steps


DIRECT = {
    "z2",
    "z3_bf16",
    "z3_groups",
}  # written by save_checkpoint(format="deepspeed"), the others by convert


@pytest.mark.integration
def test_zeroshard_checkpoint_resumes_in_deepspeed(ds_dir: Path, tmp_path: Path) -> None:
    """DeepSpeed -> zeroshard -> DeepSpeed's layout -> DeepSpeed resumes and takes DeepSpeed's own next
    steps. Two ways back: zeroshard at W=4 (another stage) saves its own format and `zeroshard convert
    --to deepspeed` lays it out for W=2 at DeepSpeed's stage; or zeroshard at W=2 at that stage saves with
    save_checkpoint(format="deepspeed")."""
    from zeroshard.cli.convert import main as convert_main

    native, back = tmp_path / "native", tmp_path / "back"
    run_distributed(save_worker, 4, str(ds_dir), str(native), False)
    run_distributed(save_worker, 2, str(ds_dir), str(back), True)
    for name, stage, _ in ZERO_CASES:
        if name not in DIRECT:
            args = [str(native / name), str(back / name / "ckpt"), "--to", "deepspeed"]
            assert convert_main([*args, "--world-size", "2", "--stage", str(stage)]) == 0
    assert not [p for p in (back / "z2" / "ckpt").iterdir() if p.name.startswith(".")]  # staging removed
    run_deepspeed(back, resume=back)
    # DeepSpeed's own zero_to_fp32 reads each directory zeroshard wrote to the same fp32 weights that
    # zeroshard's reader finds there.
    from zeroshard.checkpoint import get_fp32_state_dict

    for name, _, _ in ZERO_CASES:
        ckpt, dumped = back / name / "ckpt", tmp_path / f"{name}-zero_to_fp32.pt"
        code = (
            "import sys, torch\n"
            "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint as get\n"
            "torch.save({k: v.clone() for k, v in get(sys.argv[1]).items()}, sys.argv[2])\n"
        )
        done = subprocess.run(
            [_ds_python(), "-c", code, str(ckpt), str(dumped)],
            env=_ds_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        theirs = torch.load(dumped, weights_only=True)
        ours = get_fp32_state_dict(str(ckpt))
        trained = {k: v for k, v in ours.items() if k in theirs}
        assert trained and sorted(trained) == sorted(theirs), (name, sorted(theirs), sorted(ours))
        for key, value in theirs.items():
            assert torch.equal(value.float(), trained[key].float()), f"{name} {key}: zero_to_fp32 differs"
    scaler = _result(back / "fp16_scaler.pt")  # DeepSpeed unpickled zeroshard's fp16 loss scaler
    assert scaler["class"] == "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"
    assert scaler["cur_scale"] not in (2.0**8, 1.0) and scaler["scale_window"] == 2 and scaler["dynamic"]
    for name, _, _ in ZERO_CASES:
        want, got = _result(ds_dir / name / "after.pt"), _result(back / name / "resumed.pt")
        assert got["note"] == "from zeroshard"
        _close(got["after"], want["after"], 1e-5, f"{name} losses in DeepSpeed")
        for pname, value in want["weights"].items():
            _close(got["weights"][pname], value, 1e-5, f"{name} {pname} in DeepSpeed")
        assert int(got["global_steps"]) == int(want["global_steps"])
        assert float(got["lr"]) == pytest.approx(float(want["lr"]), rel=1e-12)


@pytest.mark.integration
def test_deepspeed_written_checkpoint_reads_back(ds_dir: Path, tmp_path: Path) -> None:
    """DeepSpeed -> DeepSpeed at another world size (zeroshard as the offline resharder): every master and
    moment equal to the source's, and zeroshard reads its own output."""
    from zeroshard.checkpoint.deepspeed.writer import write_deepspeed_checkpoint

    for name, stage, _ in ds.CASES:
        for world_size, out_stage in [(3, max(stage, 1)), (1, 3 if stage != 3 else 1)]:
            out = tmp_path / f"{name}-{world_size}"
            with open_checkpoint(ds_dir / name / "ckpt") as src:
                write_deepspeed_checkpoint(src, out, world_size=world_size, stage=out_stage)
            with open_checkpoint(ds_dir / name / "ckpt") as src, open_checkpoint(out) as dst:
                assert dst.world_size == world_size and dst.stage == out_stage
                assert dst.aliases == src.aliases and list(dst.params) == list(src.params)
                assert dst.meta["client_state"] == {"note": "from deepspeed"}
                for pname in src.params:
                    n = src.numel(pname)
                    assert torch.equal(dst.read_range(pname, 0, n), src.read_range(pname, 0, n)), pname
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(dst.read_state(pname, 0, n, key), src.read_state(pname, 0, n, key))
                    step = float(src.read_state(pname, 0, n, "step"))  # bf16 stage 0 counts one more
                    assert float(dst.read_state(pname, 0, n, "step")) == step and step >= ds.BEFORE
                for key in src.module_extra:
                    assert torch.equal(dst.read_full(key), src.read_full(key)), key
