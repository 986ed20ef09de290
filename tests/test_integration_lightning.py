"""Lightning on zeroshard (#23): Lightning's own ``deepspeed_stage_*`` strategies under the
``import deepspeed`` alias (ZEROSHARD_AS_DEEPSPEED=1), and ``ZeroshardStrategy``
(``zeroshard.integrations.lightning``) without it.

Every run is tests/integration_scripts/lightning_train.py under ``torchrun --nproc-per-node 2`` (gloo, CPU):
a tiny MLP built in ``configure_model``, AdamW, 2 micro-batches per step, 3 epochs of 2 steps, a checkpoint
at each epoch's end. Each ZeRO case is compared with the same script under ``strategy="ddp"``: every
micro-batch loss on both ranks and the final weights within 1e-4 relative. Each case also resumes from its
own epoch-1 checkpoint (``fit(ckpt_path=...)``) and must reproduce the uninterrupted run's last epoch and
final weights exactly; at stage 3 the weights in the saved sharded checkpoint must equal the live ones
element for element.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, StrategyRegistry

from zeroshard.checkpoint import get_fp32_state_dict
from zeroshard.config import load_config
from zeroshard.integrations.lightning import (
    NO_EFFECT,
    STRATEGY_NAMES,
    ZeroshardStrategy,
    convert_zero_checkpoint_to_fp32_state_dict,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "integration_scripts" / "lightning_train.py"
REL = 1e-4
LOSSES_PER_EPOCH = 4  # micro-batches per rank per epoch

pytestmark = pytest.mark.integration


# -- runs ------------------------------------------------------------------------------------------------


def _env(alias: bool, package: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROSHARD_", "PL_", "LIGHTNING_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        LIGHTNING_PACKAGE=package,
    )
    if alias:
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    return env


def _train(
    out: Path,
    strategy: str,
    *,
    alias: bool = False,
    resume_from: Path | None = None,
    package: str = "lightning.pytorch",
) -> dict[str, Any]:
    """Run the script at W=2; return its losses per rank, final weights and what it recorded."""
    out.mkdir(parents=True)
    args = ["--strategy", strategy, "--out", str(out)]
    if strategy.startswith("deepspeed"):
        args.append("--cpu-deepspeed")  # Lightning's DeepSpeedStrategy accepts only CUDA (see the script)
    if resume_from is not None:
        args += ["--resume-dir", str(resume_from / "ckpt"), "--resume-epoch", "1"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(SCRIPT), *args],
        cwd=out,
        env=_env(alias, package),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{strategy} (alias={alias}):\n{done.stdout[-8000:]}"
    return {
        "losses": [json.loads((out / f"losses_rank{r}.json").read_text()) for r in (0, 1)],
        "weights": torch.load(out / "weights.pt"),
        "summary": json.loads((out / "summary.json").read_text()),
        "info": json.loads((out / "info.json").read_text()),
        "dir": out,
        "log": done.stdout,
    }


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("ddp") / "run", "ddp")


def _assert_close_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        err = (got[key] - value).abs().max().item()
        assert err <= REL * value.abs().max().item(), f"{what}: {key} differs by {err}"


def _check_case(tmp_path: Path, strategy: str, ddp: dict[str, Any], *, alias: bool) -> dict[str, Any]:
    """Train, compare with DDP, resume from the epoch-1 checkpoint, compare with the uninterrupted run."""
    run = _train(tmp_path / "full", strategy, alias=alias)
    _check_against_ddp(run, ddp, strategy)
    _check_resume(tmp_path, run, strategy, alias=alias)
    return run


def _check_against_ddp(run: dict[str, Any], ddp: dict[str, Any], strategy: str) -> None:
    assert len(run["losses"][0]) == 3 * LOSSES_PER_EPOCH
    for rank in (0, 1):
        assert run["losses"][rank] == pytest.approx(ddp["losses"][rank], rel=REL), f"{strategy} rank {rank}"
    _assert_close_weights(run["weights"], ddp["weights"], f"{strategy} final weights vs DDP")
    assert run["summary"]["total"] == ddp["summary"]["total"] == 172


def _check_resume(tmp_path: Path, run: dict[str, Any], strategy: str, *, alias: bool) -> None:
    resumed = _train(tmp_path / "resumed", strategy, alias=alias, resume_from=run["dir"])
    for rank in (0, 1):
        assert resumed["losses"][rank] == run["losses"][rank][-LOSSES_PER_EPOCH:], f"resumed rank {rank}"
    for key, value in run["weights"].items():
        assert torch.equal(resumed["weights"][key], value), f"{strategy} resumed: {key}"


# -- Lightning's own DeepSpeed strategies under the alias -------------------------------------------------


@pytest.mark.timeout(400)
def test_deepspeed_stage_2_under_alias(tmp_path: Path, ddp: dict[str, Any]) -> None:
    run = _check_case(tmp_path, "deepspeed_stage_2", ddp, alias=True)
    assert run["info"] == {"strategy": "DeepSpeedStrategy", "deepspeed": "zeroshard.deepspeed"}
    # Lightning's DeepSpeed checkpoint layout: a directory holding the tag "checkpoint"
    assert (run["dir"] / "ckpt" / "epoch=1.ckpt" / "checkpoint" / "metadata.json").is_file()


@pytest.mark.timeout(400)
def test_deepspeed_stage_3_under_alias(tmp_path: Path, ddp: dict[str, Any]) -> None:
    run = _check_case(tmp_path, "deepspeed_stage_3", ddp, alias=True)
    assert run["info"] == {"strategy": "DeepSpeedStrategy", "deepspeed": "zeroshard.deepspeed"}
    # Lightning's ZeRO-3 summary: full sizes from ds_numel, this rank's share from partition_numel()
    assert run["summary"]["type"] == "DeepSpeedSummary"
    assert "Params per Device" in run["summary"]["text"]
    # the sharded checkpoint holds exactly the weights the run ended with
    saved = get_fp32_state_dict(run["dir"] / "ckpt" / "epoch=2.ckpt" / "checkpoint")
    for key, value in run["weights"].items():
        assert torch.equal(saved[key], value), key
    # and the epoch-1 checkpoint matches DDP's at the same point
    ddp_epoch1 = torch.load(ddp["dir"] / "ckpt" / "epoch=1.ckpt", weights_only=False)["state_dict"]
    saved1 = get_fp32_state_dict(run["dir"] / "ckpt" / "epoch=1.ckpt" / "checkpoint")
    _assert_close_weights(saved1, ddp_epoch1, "stage-3 epoch-1 checkpoint vs DDP's")


@pytest.mark.timeout(400)
def test_deepspeed_stage_2_offload_under_alias(tmp_path: Path, ddp: dict[str, Any]) -> None:
    run = _check_case(tmp_path, "deepspeed_stage_2_offload", ddp, alias=True)
    assert run["info"]["deepspeed"] == "zeroshard.deepspeed"


@pytest.mark.timeout(300)
def test_standalone_pytorch_lightning_under_alias(tmp_path: Path, ddp: dict[str, Any]) -> None:
    run = _train(tmp_path / "pl", "deepspeed_stage_3", alias=True, package="pytorch_lightning")
    for rank in (0, 1):
        assert run["losses"][rank] == pytest.approx(ddp["losses"][rank], rel=REL)
    _assert_close_weights(run["weights"], ddp["weights"], "pytorch_lightning stage 3 vs DDP")
    assert run["summary"]["type"] == "DeepSpeedSummary"


# -- ZeroshardStrategy, no alias ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zeroshard_stage_3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("zs3") / "full", "zeroshard_stage_3")


@pytest.mark.timeout(400)
def test_zeroshard_stage_3_strategy(
    tmp_path: Path, ddp: dict[str, Any], zeroshard_stage_3: dict[str, Any]
) -> None:
    run = zeroshard_stage_3
    _check_against_ddp(run, ddp, "zeroshard_stage_3")
    _check_resume(tmp_path, run, "zeroshard_stage_3", alias=False)
    assert run["info"] == {"strategy": "ZeroshardStrategy", "deepspeed": None}  # never imported
    assert run["summary"]["type"] == "DeepSpeedSummary"


@pytest.mark.timeout(300)
def test_zeroshard_single_file_checkpoint(tmp_path: Path, zeroshard_stage_3: dict[str, Any]) -> None:
    run = zeroshard_stage_3
    # one Lightning checkpoint file from the sharded directory: the final weights exactly, Lightning's state
    single = tmp_path / "final.ckpt"
    convert_zero_checkpoint_to_fp32_state_dict(run["dir"] / "ckpt" / "epoch=2.ckpt", single)
    checkpoint = torch.load(single, weights_only=False)
    assert checkpoint["epoch"] == 2 and checkpoint["global_step"] == 6
    for key, value in run["weights"].items():
        assert torch.equal(checkpoint["state_dict"][key], value), key

    # validate from that file under ZeRO-3 with load_full_weights=True: each rank's losses are those of
    # the final weights on its DistributedSampler rows (rank r: rows r, r+2, ..., batches of 4)
    out = tmp_path / "validate"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = ["--strategy", "zeroshard_stage_3", "--out", str(out), "--validate-full-weights", str(single)]
    done = subprocess.run(
        [*command, str(SCRIPT), *args],
        cwd=out,
        env=_env(False, "lightning.pytorch"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-8000:]
    model, x, y = _reference_model_and_data(run["weights"])
    for rank in (0, 1):
        rows = torch.arange(rank, len(x), 2)
        with torch.no_grad():
            want = [
                torch.nn.functional.mse_loss(model(x[rows[i : i + 4]]), y[rows[i : i + 4]]).item()
                for i in range(0, len(rows), 4)
            ]
        got = json.loads((out / f"losses_rank{rank}.json").read_text())
        assert got == pytest.approx(want, rel=1e-6), f"validate rank {rank}"


def _reference_model_and_data(
    weights: dict[str, torch.Tensor],
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import lightning_train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    module = lightning_train.TinyRegression()
    module.configure_model()
    module.load_state_dict(weights)
    x, y = module.train_dataloader().dataset.tensors
    return module, x, y


@pytest.mark.timeout(400)
def test_zeroshard_stage_2_offload_strategy(tmp_path: Path, ddp: dict[str, Any]) -> None:
    run = _check_case(tmp_path, "zeroshard_stage_2_offload", ddp, alias=False)
    assert run["info"] == {"strategy": "ZeroshardStrategy", "deepspeed": None}


# -- ZeroshardStrategy, no processes -------------------------------------------------------------------------


def test_strategy_names_registered() -> None:
    for name, (_, params) in STRATEGY_NAMES.items():
        assert StrategyRegistry[name]["strategy"] is ZeroshardStrategy
        strategy = StrategyRegistry.get(name)
        zero = strategy.config["zero_optimization"]
        assert zero["stage"] == params.get("stage", 2), name
        assert ("offload_optimizer" in zero) == params.get("offload_optimizer", False), name
        assert ("offload_param" in zero) == params.get("offload_parameters", False), name
        assert "aio" not in strategy.config and "activation_checkpointing" not in strategy.config
    assert {"zeroshard_stage_1", "zeroshard_stage_2", "zeroshard_stage_3"} <= set(STRATEGY_NAMES)
    assert {"zeroshard_stage_2_offload", "zeroshard_stage_3_offload"} <= set(STRATEGY_NAMES)


def test_arguments_match_lightning_deepspeed_strategy() -> None:
    ours = inspect.signature(ZeroshardStrategy.__init__).parameters
    theirs = inspect.signature(DeepSpeedStrategy.__init__).parameters
    assert list(ours) == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
    for name, default in NO_EFFECT.items():
        assert theirs[name].default == default, name


@pytest.mark.parametrize("name", sorted(NO_EFFECT))
def test_arguments_without_effect_raise(name: str) -> None:
    default = NO_EFFECT[name]
    other = (not default) if isinstance(default, bool) else default + 1
    with pytest.raises(ValueError, match=name):
        ZeroshardStrategy(**{name: other})
    ZeroshardStrategy(**{name: default})  # the default is what you get anyway: accepted


def test_built_configs_load_without_warnings(tmp_path: Path) -> None:
    """What the strategy names and an NVMe setup build is a ds_config zeroshard takes as it is."""
    nvme = {"offload_params_device": "nvme", "offload_optimizer_device": "nvme", "nvme_path": str(tmp_path)}
    cases = [params for _, params in STRATEGY_NAMES.values()]
    cases.append({"stage": 3, "offload_optimizer": True, "offload_parameters": True, **nvme})
    for params in cases:
        config = dict(ZeroshardStrategy(**params).config, train_micro_batch_size_per_gpu=4)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loaded = load_config(config, world_size=2, optimizer_given=True)  # the LightningModule's
        assert loaded.zero_optimization.stage == params.get("stage", 2), params
    assert loaded.aio.intra_op_parallelism == 1  # Lightning's thread_count, under its current name


def test_bad_stage_raises() -> None:
    with pytest.raises(ValueError, match="stage"):
        ZeroshardStrategy(stage=4)


def test_config_argument_replaces_the_built_one(tmp_path: Path) -> None:
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    assert ZeroshardStrategy(config=config).config == config
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    assert ZeroshardStrategy(config=str(path)).zero_stage_3


def _self_assignments(function: Any) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def test_init_sets_what_lightning_sets() -> None:
    """ZeroshardStrategy.__init__ replaces DeepSpeedStrategy.__init__: it must set the same attributes."""
    missing = _self_assignments(DeepSpeedStrategy.__init__) - _self_assignments(ZeroshardStrategy.__init__)
    assert not missing


def test_every_deepspeed_import_is_overridden() -> None:
    """Each DeepSpeedStrategy method that imports deepspeed has an override (the strategy's invariant)."""
    importing = [
        name
        for name, member in vars(DeepSpeedStrategy).items()
        if callable(getattr(member, "__wrapped__", member))
        and "import deepspeed" in inspect.getsource(getattr(member, "__wrapped__", member))
    ]
    assert importing, "Lightning's DeepSpeedStrategy no longer imports deepspeed in a method"
    assert [name for name in importing if name not in vars(ZeroshardStrategy)] == []


def test_lightning_sees_deepspeed_under_the_alias() -> None:
    """Import-time checks Lightning makes, in a fresh process started with the alias switched on."""
    probe = (
        "from lightning.fabric.strategies.deepspeed import _DEEPSPEED_AVAILABLE as a, "
        "_DEEPSPEED_GREATER_EQUAL_0_16 as b\n"
        "from lightning.pytorch.strategies import DeepSpeedStrategy\n"
        "import deepspeed\n"
        "s = DeepSpeedStrategy(stage=3)\n"
        "print(bool(a), bool(b), deepspeed.__name__, s.zero_stage_3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=_env(True, "lightning.pytorch"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["True", "True", "zeroshard.deepspeed", "True"]
