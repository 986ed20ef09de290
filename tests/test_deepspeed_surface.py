"""DeepSpeed's whole public surface in ``zeroshard.deepspeed``, checked against the inventory read off the
real DeepSpeed (``zeroshard/deepspeed/inventory.json``, [Note: generated surface]).

- Under ``ZEROSHARD_AS_DEEPSPEED=1`` every module of the inventory imports as ``deepspeed.X``, every name
  resolves, and every callable takes DeepSpeed's parameters: each of DeepSpeed's parameters by name, in
  DeepSpeed's position, with DeepSpeed's default (zeroshard may add parameters with defaults).
- The inventory is what ``tools/deepspeed_inventory.py`` writes from the DeepSpeed installed beside the
  tests, and ``docs/deepspeed-surface.md`` is what ``tools/deepspeed_surface_report.py`` writes.
- Refused names refuse at use, never at import, after DeepSpeed's own argument check; reproduced values are
  DeepSpeed's; one object keeps one identity under all of DeepSpeed's names for it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
INVENTORY = ROOT / "zeroshard" / "deepspeed" / "inventory.json"

# Where zeroshard's callable deliberately differs from DeepSpeed's signature, keyed by (defining module,
# name), with the reason. Everything else must match.
KNOWN_DIFFERENCES = {
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): (
        "built by deepspeed.initialize (DeepSpeed's arguments); its constructor takes zeroshard's parts"
    ),
    ("deepspeed.comm.comm", "ProcessGroup"): (
        "torch's ProcessGroup, the class DeepSpeed's groups are at run time (DeepSpeed's is an unused stub)"
    ),
}
# Defaults zeroshard does not copy: ``debug`` is an artefact of DeepSpeed's import (its caller's name at
# import time); ``tensor_overrides`` lists the tensor constructors DeepSpeed's Init overrides, and zeroshard's
# Init overrides none.
IGNORED_DEFAULTS = {
    ("deepspeed.comm.comm", "allgather_fn", "debug"),
    ("deepspeed.comm.comm", "reduce_scatter_fn", "debug"),
    ("deepspeed.runtime.zero.partition_parameters", "Init", "tensor_overrides"),
}


def _default_text(value: Any) -> str:
    # torch's ReduceOp members print as RedOpType; DeepSpeed's own ReduceOp enum prints as ReduceOp.
    return repr(value).replace("<RedOpType.", "<ReduceOp.")


def _same_default(ours: Any, theirs: str) -> bool:
    # DeepSpeed's config models print large integer defaults with digit groups (its pp_int: 100,000,000).
    grouped = re.fullmatch(r"\d{1,3}(,\d{3})+", theirs) is not None
    text = _default_text(ours)
    if (
        text == theirs
        or (grouped and text == theirs.replace(",", ""))
        or (theirs, ours) == ("sys.maxsize", sys.maxsize)
    ):
        return True
    # A float default where DeepSpeed's is the equal int (zeroshard's fp16 block: loss_scale 0.0).
    return isinstance(ours, float) and re.fullmatch(r"-?\d+", theirs) is not None and ours == int(theirs)


def signature_problems(theirs: list[list[Any]], ours: inspect.Signature, ignored: set[str]) -> list[str]:
    """How ``ours`` fails to take every call DeepSpeed's signature ``theirs`` takes (empty: it does)."""
    if all(kind in ("VAR_POSITIONAL", "VAR_KEYWORD") for _, kind, _ in theirs):
        return []  # DeepSpeed's wrapper takes anything and passes it on
    mine = list(ours.parameters.values())
    by_name = {p.name: p for p in mine}
    has_var = {p.kind for p in mine}
    problems = []
    for position, (name, kind, default) in enumerate(theirs):
        param = by_name.get(name)
        if param is None:
            if getattr(inspect.Parameter, kind) in has_var and kind.startswith("VAR_"):
                continue
            problems.append(f"no parameter {name!r}")
            continue
        positional = kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
        if positional and (position >= len(mine) or mine[position].name != name):
            problems.append(f"{name!r} is not parameter {position}")
        if default is not None and name not in ignored:
            if param.default is inspect.Parameter.empty:
                problems.append(f"{name!r} has no default (DeepSpeed: {default})")
            elif not _same_default(param.default, default):
                problems.append(f"{name!r} defaults to {param.default!r} (DeepSpeed: {default})")
    theirs_names = {name for name, _, _ in theirs}
    for param in mine:
        optional = param.default is not inspect.Parameter.empty or param.kind in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        )
        if param.name not in theirs_names and not optional:
            problems.append(f"extra required parameter {param.name!r}")
    return problems


def walk() -> dict[str, list[Any]]:
    """Import every inventory module as ``deepspeed.X`` and check every name (run with the alias on)."""
    import warnings

    warnings.simplefilter("ignore")
    inventory = json.loads(INVENTORY.read_text())["modules"]
    found: dict[str, list[Any]] = {"import": [], "resolve": [], "kind": [], "signature": []}
    for ds_module, entry in inventory.items():
        try:
            module = importlib.import_module(ds_module)
        except Exception as error:
            found["import"].append([ds_module, repr(error)])
            continue
        for name, item in entry["names"].items():
            try:
                value = getattr(module, name)
            except Exception as error:
                found["resolve"].append([ds_module, name, repr(error)])
                continue
            params = item.get("signature")
            home = item.get("defined_in", ds_module)
            if item["kind"] not in ("function", "class") or params is None:
                continue
            if inspect.ismodule(value):  # DeepSpeed's package imports the function over its submodule
                found["kind"].append([ds_module, name, f"module {value.__name__}, not a {item['kind']}"])
                continue
            if (home, name) in KNOWN_DIFFERENCES:
                continue  # a documented difference
            try:
                ours = inspect.signature(value)
            except (TypeError, ValueError) as error:
                found["signature"].append([ds_module, name, repr(error)])
                continue
            ignored = {p for (m, n, p) in IGNORED_DEFAULTS if (m, n) == (home, name)}
            problems = signature_problems(params, ours, ignored)
            if problems:
                found["signature"].append([ds_module, name, problems])
    return found


def _alias_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    return {**env, "ZEROSHARD_AS_DEEPSPEED": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.timeout(240)
def test_every_inventory_module_imports_and_every_name_resolves_with_deepspeeds_signature() -> None:
    done = subprocess.run(
        [sys.executable, __file__], env=_alias_env(), capture_output=True, text=True, timeout=200, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    clean: dict[str, list[Any]] = {"import": [], "resolve": [], "kind": [], "signature": []}
    assert found == clean, json.dumps(found, indent=1)[:6000]


def test_signature_rule() -> None:
    """The comparison itself: what it accepts and what it names."""

    def ds(a, b=1, *args, c=None, **kwargs): ...  # type: ignore[no-untyped-def]

    theirs = [
        [p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
        for p in inspect.signature(ds).parameters.values()
    ]

    def same(a, b=1, *args, c=None, d=2, **kwargs): ...  # type: ignore[no-untyped-def]

    def wrong(b, a=0, *, c=3, e): ...  # type: ignore[no-untyped-def]

    assert signature_problems(theirs, inspect.signature(same), set()) == []
    assert signature_problems(theirs, inspect.signature(wrong), set()) == [
        "'a' is not parameter 0",
        "'b' is not parameter 1",
        "'b' has no default (DeepSpeed: 1)",
        "no parameter 'args'",
        "'c' defaults to 3 (DeepSpeed: None)",
        "no parameter 'kwargs'",
        "extra required parameter 'e'",
    ]
    assert signature_problems([["x", "VAR_POSITIONAL", None]], inspect.signature(wrong), set()) == []


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_inventory_is_what_the_installed_deepspeed_gives(tmp_path: Path) -> None:
    """Regenerating from the DeepSpeed the dev extra pins changes nothing (``make deepspeed-inventory``)."""
    env = {k: v for k, v in os.environ.items() if k != "ZEROSHARD_AS_DEEPSPEED"}
    out = tmp_path / "inventory.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "deepspeed_inventory.py"), "--output", str(out)],
        env={**env, "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""},
        check=True,
        capture_output=True,
        timeout=200,
    )
    fresh, committed = json.loads(out.read_text()), json.loads(INVENTORY.read_text())
    differing = sorted(
        m
        for m in fresh["modules"].keys() | committed["modules"].keys()
        if fresh["modules"].get(m) != committed["modules"].get(m)
    )
    assert not differing, f"modules whose entries differ (run `make deepspeed-inventory`): {differing[:20]}"
    assert fresh == committed


@pytest.mark.timeout(240)
def test_surface_page_is_current(tmp_path: Path) -> None:
    """docs/deepspeed-surface.md and the counts in docs/porting.md say what the tree provides now (``make
    deepspeed-surface``)."""
    out, porting = tmp_path / "surface.md", tmp_path / "porting.md"
    tool = ROOT / "tools" / "deepspeed_surface_report.py"
    subprocess.run(
        [sys.executable, str(tool), "--output", str(out), "--porting", str(porting)],
        check=True,
        capture_output=True,
        timeout=200,
        cwd=ROOT,
    )
    assert out.read_text() == (ROOT / "docs" / "deepspeed-surface.md").read_text(), (
        "docs/deepspeed-surface.md is stale: run `make deepspeed-surface`"
    )
    assert porting.read_text() == (ROOT / "docs" / "porting.md").read_text(), (
        "docs/porting.md's counts are stale: run `make deepspeed-surface`"
    )


def test_refused_names_import_and_refuse_at_use() -> None:
    from zeroshard.deepspeed.runtime.pipe import module as pipe_module

    from zeroshard.deepspeed import surface

    # Importing and naming never raises; the classes keep DeepSpeed's signatures.
    module_cls = pipe_module.PipelineModule
    assert surface.kind_of(module_cls) == "refused"
    assert list(inspect.signature(module_cls).parameters)[:3] == ["layers", "num_stages", "topology"]
    # A call DeepSpeed would reject fails as in DeepSpeed, before the refusal.
    with pytest.raises(TypeError):
        module_cls(no_such_argument=1)
    with pytest.raises(
        NotImplementedError, match=r"deepspeed\.runtime\.pipe\.module\.PipelineModule.*pipeline"
    ):
        module_cls(layers=[])
    import zeroshard.deepspeed as deepspeed

    with pytest.raises(NotImplementedError, match=r"init_inference\(\).*docs/porting.md#refused-at-use"):
        deepspeed.init_inference(model=None)
    # Methods read on a refused class are refused too; other attributes are plain AttributeErrors.
    from zeroshard.deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    with pytest.raises(NotImplementedError, match="sequence parallelism"):
        UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=None, sequence_parallel_size=2)
    assert not hasattr(UlyssesSPAttentionHF, "no_such_thing")
    # Subclassing a refused class at import time works (the refusal comes at construction).
    subclass = type("Mine", (module_cls,), {})
    with pytest.raises(NotImplementedError):
        subclass(layers=[])


@pytest.mark.timeout(240)
def test_left_out_subtrees_import_at_any_depth_and_refuse_at_use() -> None:
    """Modules left out of the inventory (inference kernels, sparse attention, other accelerators) still
    import, at any depth, and each of their public names refuses at use, naming why it was left out."""
    code = """
import deepspeed
from deepspeed.ops.sparse_attention import FixedSparsityConfig, SparseAttentionUtils
from deepspeed.inference.v2.ragged import DSStateManagerConfig
import deepspeed.module_inject
from deepspeed.accelerator.hpu_accelerator import HPU_Accelerator
class Mine(FixedSparsityConfig):  # subclassing at import works
    pass
for use in (lambda: FixedSparsityConfig(num_heads=4), Mine,
            lambda: SparseAttentionUtils.extend_position_embedding, lambda: DSStateManagerConfig(),
            lambda: deepspeed.module_inject.replace_transformer_layer(),
            HPU_Accelerator, lambda: deepspeed.DeepSpeedTransformerLayer(None)):
    try:
        use()
    except NotImplementedError as error:
        print("refused:", error)
    else:
        print("ran")
try:
    deepspeed.ops.sparse_attention._private
except AttributeError:
    print("private: AttributeError")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], env=_alias_env(), capture_output=True, text=True, timeout=200, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "private: AttributeError" and len(lines) == 8, lines
    assert all(line.startswith("refused: deepspeed.") for line in lines[:7]), lines
    assert "sparse attention Triton kernels" in lines[0] and "inference engines" in lines[3], lines
    assert "fused transformer-layer CUDA kernels" in lines[6] and "hpu accelerator" in lines[5], lines


@pytest.mark.timeout(240)
def test_every_deepspeed_name_our_scripts_use_resolves(tmp_path: Path) -> None:
    """tools/deepspeed_imports_check.py over the DeepSpeed-style scripts of tests/: no name is missing."""
    out = tmp_path / "names.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "deepspeed_imports_check.py"),
            str(ROOT / "tests" / "ds_scripts"),
            str(ROOT / "tests" / "integration_scripts"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=200,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kinds = [kind for kind, _ in json.loads(out.read_text()).values()]
    assert "missing" not in kinds and kinds.count("implemented") > 10, done.stdout


def test_values_enums_exceptions_and_identity_are_deepspeeds() -> None:
    import torch

    import zeroshard.deepspeed as deepspeed
    from zeroshard.deepspeed import surface
    from zeroshard.deepspeed.runtime import constants
    from zeroshard.deepspeed.runtime.zero import stage3

    inventory = surface.inventory()["modules"]
    assert constants.TRAIN_BATCH_SIZE == "train_batch_size"
    assert (
        constants.GRADIENT_ACCUMULATION_STEPS_DEFAULT
        == inventory["deepspeed.runtime.constants"]["names"]["GRADIENT_ACCUMULATION_STEPS_DEFAULT"]["value"]
    )
    # Enums: DeepSpeed's members and values.
    from zeroshard.deepspeed.runtime.zero.config import ZeroStageEnum

    members = inventory["deepspeed.runtime.zero.config"]["names"]["ZeroStageEnum"]["members"]
    assert {m.name: m.value for m in ZeroStageEnum} == members
    # Exception classes are real, catchable classes.
    from zeroshard.deepspeed.runtime.config import DeepSpeedConfigError

    assert issubclass(DeepSpeedConfigError, Exception)
    # One object under all of DeepSpeed's names for it, hand-written ones included.
    assert stage3.Init is deepspeed.zero.Init
    assert stage3.GatheredParameters is deepspeed.zero.GatheredParameters
    from zeroshard.deepspeed.ops.adam import cpu_adam

    assert cpu_adam.DeepSpeedCPUAdam is deepspeed.ops.adam.DeepSpeedCPUAdam
    assert deepspeed.checkpointing is importlib.import_module(
        "zeroshard.deepspeed.runtime.activation_checkpointing.checkpointing"
    )
    # dtypes are torch's.
    dtypes = [(m, n) for m, e in inventory.items() for n, i in e["names"].items() if i["kind"] == "dtype"]
    for module, name in dtypes[:5]:
        assert isinstance(getattr(importlib.import_module(surface.our_name(module)), name), torch.dtype)


if __name__ == "__main__":
    print(json.dumps(walk()))
