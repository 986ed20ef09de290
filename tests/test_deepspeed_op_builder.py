"""``deepspeed.ops.op_builder``, ``deepspeed.ops.__compatible_ops__`` and ``deepspeed.git_version_info``: what
zeroshard, which compiles no op, answers where DeepSpeed's build would (see op_builder/__init__.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import zeroshard.deepspeed as deepspeed
from zeroshard.deepspeed import git_version_info
from zeroshard.deepspeed.ops import op_builder

PROVIDED = {
    "cpu_adam": "DeepSpeedCPUAdam",
    "fused_adam": "FusedAdam",
    "cpu_adagrad": "DeepSpeedCPUAdagrad",
    "fused_lamb": "FusedLamb",
    "cpu_lion": "DeepSpeedCPULion",
    "fused_lion": "FusedLion",
}


def test_compatible_exactly_where_zeroshard_provides_the_op() -> None:
    assert deepspeed.ops.__compatible_ops__ is op_builder.__compatible_ops__
    compatible = {name for name, ok in op_builder.__compatible_ops__.items() if ok}
    assert compatible == set(PROVIDED)
    assert set(op_builder.__compatible_ops__) == {b.NAME for b in op_builder.ALL_BUILDERS}
    for builder in op_builder.ALL_BUILDERS:
        assert builder().is_compatible() is (builder.NAME in PROVIDED)
        if builder.NAME in PROVIDED:
            # The class named as the provider exists, under that name, in zeroshard's deepspeed.ops.
            module, _, name = (builder.PROVIDED_BY or "").rpartition(".")
            assert name == PROVIDED[builder.NAME]
            assert callable(
                getattr(
                    __import__(module.replace("deepspeed", "zeroshard.deepspeed", 1), fromlist=[name]), name
                )
            )


@pytest.mark.parametrize("method", ["load", "jit_load", "builder"])
def test_load_says_zeroshard_builds_no_ops(method: str) -> None:
    for builder in (op_builder.FusedAdamBuilder(), op_builder.AsyncIOBuilder()):
        with pytest.raises(NotImplementedError, match=type(builder).__name__) as info:
            getattr(builder, method)()
        assert "zeroshard builds no DeepSpeed ops" in str(info.value)
    with pytest.raises(NotImplementedError, match=r"deepspeed\.ops\.adam\.FusedAdam"):
        op_builder.FusedAdamBuilder().load()


def test_git_version_info_describes_this_process() -> None:
    assert git_version_info.version == deepspeed.__version__
    assert git_version_info.installed_ops == {b.NAME: False for b in op_builder.ALL_BUILDERS}
    assert git_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    expected_cuda = ".".join(torch.version.cuda.split(".")[:2]) if torch.version.cuda else "0.0"
    assert git_version_info.torch_info["cuda_version"] == expected_cuda
    assert git_version_info.accelerator_name == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_every_builder_of_deepspeed_with_its_name_and_build_variable() -> None:
    """Real DeepSpeed's builder classes (its CUDA and CPU builder modules), with ``NAME`` and ``BUILD_VAR``,
    are all here with the same values."""
    probe = """
import importlib, json, pkgutil, os, deepspeed.ops.op_builder as ob
found = {}
for package in ("deepspeed.ops.op_builder", "deepspeed.ops.op_builder.cpu"):
    path = os.path.dirname(importlib.import_module(package).__file__)
    for info in pkgutil.iter_modules([path]):
        if info.ispkg or info.name in ("all_ops", "builder"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("Builder") and isinstance(value, type) and "NAME" in vars(value):
                found[name] = [value.NAME, getattr(value, "BUILD_VAR", "")]
print(json.dumps({"builders": found, "exported": sorted(n for n in dir(ob) if n.endswith("Builder"))}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "PYTHONPATH")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    real = json.loads(out.stdout.strip().splitlines()[-1])
    ours = {b.__name__: [b.NAME, b.BUILD_VAR] for b in op_builder.ALL_BUILDERS}
    for name, (ds_name, build_var) in real["builders"].items():
        assert ours.get(name) == [ds_name, build_var], name
    missing = set(real["exported"]) - set(ours) - {"OpBuilder"}
    assert not missing, f"builders DeepSpeed exports that zeroshard lacks: {sorted(missing)}"
