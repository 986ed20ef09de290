"""DeepSpeed's own public-API unit tests, run against real DeepSpeed and against zeroshard's ``deepspeed``.

    .venv/bin/python bench/deepspeed_conformance.py /path/to/DeepSpeed            # both sides, ~2 x 5-15 min
    .venv/bin/python bench/deepspeed_conformance.py /path/to/DeepSpeed --side zeroshard \\
        --previous bench/results/deepspeed_conformance.json                        # rerun one side only

The argument is a DeepSpeed checkout: a work tree, or a git directory (bare or ``.git``), whose ``tests/``
is taken at ``HEAD``. Only ``tests/`` is copied, to a temporary directory: DeepSpeed's conftest puts the
checkout's root on ``sys.path``, and a checkout's ``deepspeed/`` sources must not shadow what is tested.
Nothing of DeepSpeed's is copied into this repository.

Each side is one pytest run over the cases in ``CASES`` (public-API behaviour: initialize, config loading
and config models, no_sync, zero.Init / GatheredParameters, leaf modules, the tensor-fragment accessors,
checkpoints, LR schedules, monitors, comm and runtime utilities; chosen so that the DistributedTest harness
runs them at world size 1 or 2, on CPU, in a few seconds each) with ``DS_ACCELERATOR=cpu`` and no GPU
visible:

- ``deepspeed``: the DeepSpeed installed in this interpreter (``ZEROSHARD_AS_DEEPSPEED`` unset);
- ``zeroshard``: ``ZEROSHARD_AS_DEEPSPEED=1``, so ``import deepspeed`` gives ``zeroshard.deepspeed`` in the
  test process and in every worker the harness starts (the alias finder comes first on ``sys.meta_path``).

``PYTHONPATH`` holds only a plugin that records each case's outcome (and, with ``--zeroshard-tree``, a
zeroshard source tree to test instead of the installed one). DeepSpeed's harness (``tests/unit/common.py``)
starts ``world_size`` workers per test through a ``forkserver`` pool, rendezvous through a ``file://``
store, and joins with ``deepspeed.init_distributed(get_accelerator().communication_backend_name(),
init_method=..., rank=..., world_size=...)``: gloo on the CPU accelerator. It skips a case whose world size
exceeds ``get_accelerator().device_count()``, which on the CPU is ``LOCAL_SIZE``: the runs set it to 2.

Prints one line per case and the counts, and writes ``bench/results/deepspeed_conformance.json`` (each case's
outcome and first error line per side). docs/porting.md ("Conformance with DeepSpeed's unit tests") lists
the cases DeepSpeed passes and zeroshard does not, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "deepspeed_conformance.json"
SIDES = ("deepspeed", "zeroshard")

_CFG = "unit/runtime/test_ds_config_dict.py::"
_INIT = "unit/runtime/test_ds_initialize.py::"
_SYNC = "unit/runtime/test_no_sync_ctxt.py::TestNoSyncCtxt::"
_CTX = "unit/runtime/zero/test_zero_context.py::"
_ZOPT = "unit/checkpoint/test_zero_optimizer.py::"
_LRS = "unit/checkpoint/test_lr_scheduler.py::TestLRSchedulerCheckpoint::"
_FRAG = "unit/runtime/zero/test_zero_tensor_fragment.py::"

# pytest node ids under tests/ of DeepSpeed's checkout. A file or class name selects all of its cases.
# Parametrized cases are thinned (fp32 and one other dtype, the stages that differ) to keep each side's
# run near ten minutes on two cores; no case needs more than two ranks.
CASES: tuple[str, ...] = (
    # deepspeed.initialize: optimizers, schedulers, no optimizer
    f"{_INIT}test_start_method_safety",
    f"{_INIT}TestNoOptim",
    f"{_INIT}TestClientOptimizer",
    f"{_INIT}TestConfigOptimizer",
    f"{_INIT}TestBf16ZeRO0UnfusedOptimizer",
    f"{_INIT}TestOptimizerImplementation::test[None-fp32-zero1]",
    f"{_INIT}TestOptimizerImplementation::test[None-fp32-zero2]",
    f"{_INIT}TestOptimizerImplementation::test[None-fp32-zero3]",
    f"{_INIT}TestOptimizerImplementation::test[None-fp32-None]",
    f"{_INIT}TestClientLrScheduler::test[None-None]",
    f"{_INIT}TestClientLrScheduler::test[Optimizer-_LRScheduler]",
    f"{_INIT}TestClientLrScheduler::test[Callable-_LRScheduler]",
    f"{_INIT}TestClientLrSchedulerInit::test_same_lrscheler_and_callable[None]",
    f"{_INIT}TestClientLrSchedulerInit::test_diff_lrscheler_and_callable[None]",
    # the config: files (JSON, hjson, base64), batch arithmetic, errors, the config model
    f"{_CFG}TestBasicConfig",
    f"{_CFG}TestBatchConfig::test[2-32-16-1-True]",
    f"{_CFG}TestBatchConfig::test[2-33-17-2-False]",
    f"{_CFG}test_temp_config_json",
    f"{_CFG}test_gradient_allreduce_op",
    f"{_CFG}test_gradient_allreduce_op_default",
    f"{_CFG}test_invalid_gradient_allreduce_op",
    f"{_CFG}test_sum_gradient_allreduce_rejects_zero3",
    f"{_CFG}test_gather_16bit_params_on_model_save",
    f"{_CFG}test_get_bfloat16_enabled",
    f"{_CFG}TestConfigLoad",
    f"{_CFG}TestDeprecatedDeepScaleConfig",
    f"{_CFG}TestDistInit",
    f"{_CFG}TestInitNoOptimizer",
    f"{_CFG}TestArgs",
    f"{_CFG}TestNoModel",
    "unit/runtime/test_ds_config_model.py",
    "unit/runtime/zero/test_zero_config.py",
    # engine.no_sync (dtype2 is fp32, dtype1 bf16)
    f"{_SYNC}test_zero_stage[0-dtype2]",
    f"{_SYNC}test_zero_stage[1-dtype2]",
    f"{_SYNC}test_zero_stage[2-dtype2]",
    f"{_SYNC}test_zero_stage[3-dtype2]",
    f"{_SYNC}test_zero_stage[1-dtype1]",
    f"{_SYNC}test_engine_step[0-dtype2]",
    f"{_SYNC}test_engine_step[1-dtype2]",
    f"{_SYNC}test_multiple_ctxts[0-dtype2]",
    f"{_SYNC}test_multiple_ctxts[1-dtype2]",
    f"{_SYNC}test_reentry",
    # zero.Init, GatheredParameters
    f"{_CTX}TestZeroGatheredParametersFree",
    f"{_CTX}TestGatheredParametersAllRanksErrorOnModification",
    f"{_CTX}TestSerialContext",
    f"{_CTX}TestScatterGather",
    f"{_CTX}TestGatherUpdate",
    "unit/runtime/zero/test_zero_context_ancestry.py",
    "unit/runtime/zero/test_zero_context_return.py",
    # checkpoints
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_other_optimizer.py::TestOtherOptimizerCheckpoint::test_checkpoint_fp32_optimizer",
    f"{_LRS}test_checkpoint_lr_scheduler[0-False]",
    f"{_LRS}test_checkpoint_lr_scheduler[1-False]",
    f"{_LRS}test_checkpoint_lr_scheduler[2-False]",
    f"{_LRS}test_checkpoint_lr_scheduler[3-False]",
    f"{_LRS}test_checkpoint_no_lr_scheduler[0-False]",
    f"{_LRS}test_checkpoint_no_lr_scheduler[3-False]",
    f"{_ZOPT}TestZeROCheckpoint::test_load_optimizer_state[1-False-Adam]",
    f"{_ZOPT}TestZeROCheckpoint::test_load_optimizer_state[2-False-Adam]",
    f"{_ZOPT}TestZeROCheckpoint::test_load_optimizer_state[3-False-Adam]",
    f"{_ZOPT}TestZeROCheckpoint::test_not_load_optimizer_state[2-False-Adam]",
    f"{_ZOPT}TestZeROCheckpoint::test_load_module_only[0]",
    f"{_ZOPT}TestZeROCheckpoint::test_load_module_only[3]",
    f"{_ZOPT}TestZeROSaveLoadEdgeCase::test_immediate_save_load[0]",
    f"{_ZOPT}TestZeROSaveLoadEdgeCase::test_immediate_save_load[3]",
    f"{_ZOPT}TestZeROSaveLoadEdgeCase::test_load_immediate_save[2]",
    f"{_ZOPT}TestZeROSaveLoadEdgeCase::test_save_before_accum_grad_is_done[2]",
    f"{_ZOPT}TestSaveTensorClone::test_save_tensor_clone[False-1]",
    f"{_ZOPT}TestSaveTensorClone::test_save_tensor_clone[True-2]",
    f"{_ZOPT}test_elastic_checkpoint_is_deprecated_for_zero3",
    f"{_ZOPT}TestZeROCheckpointFrozenWeights",
    "unit/checkpoint/test_shared_weights.py",
    # the tensor-fragment accessors (safe_get_full_* / safe_*_local_*): fp32 and bf16 (dtype0), the stages
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-1-full-dtype2-False]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-2-full-dtype2-True]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-3-full-dtype2-False]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-3-local-dtype2-False]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-3-full-dtype0-True]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[none-3-local-dtype0-True]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[cpu-2-full-dtype2-False]",
    f"{_FRAG}TestTensorFragmentGet::test_zero_fragments[cpu-3-full-dtype0-False]",
    f"{_FRAG}TestTensorFragmentSet::test_zero_fragments[none-1-full-dtype2]",
    f"{_FRAG}TestTensorFragmentSet::test_zero_fragments[none-2-full-dtype2]",
    f"{_FRAG}TestTensorFragmentSet::test_zero_fragments[none-3-full-dtype2]",
    f"{_FRAG}TestTensorFragmentSet::test_zero_fragments[none-3-local-dtype2]",
    f"{_FRAG}TestTensorFragmentUpdate::test_zero_fragments[none-1-False-dtype2]",
    f"{_FRAG}TestTensorFragmentUpdate::test_zero_fragments[none-2-False-dtype2]",
    f"{_FRAG}TestTensorFragmentUpdate::test_zero_fragments[none-3-False-dtype2]",
    f"{_FRAG}TestTensorFragmentUpdate::test_zero_fragments[none-3-True-dtype0]",
    f"{_FRAG}TestTensorFragmentUpdate::test_zero_fragments[cpu-2-False-dtype2]",
    # ZeRO-3 modules: leaf modules, nesting, dynamic classes, generation, hooks, late attachment
    "unit/runtime/zero/test_zero_leaf_module.py",
    "unit/runtime/zero/test_zero_nesting_init.py",
    "unit/runtime/zero/test_zero_dynamic_class.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_hook_attribute_delegation.py",
    "unit/runtime/zero/test_zero_late_module_attach.py",
    "unit/runtime/zero/test_zero_linear_direct_init.py",
    "unit/runtime/zero/test_zero_allreduce_fetch_params.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    # [False] expects an AssertionError from inside the harness's worker; without one the harness waits
    "unit/runtime/zero/test_ignore_unused_parameters.py::TestStage2IgnoreUnusedParameters::test[True]",
    "unit/runtime/test_multi_output_model.py",
    # schedules, precision config models, monitors, runtime and comm utilities, launcher arguments
    "unit/runtime/test_lr_schedulers.py",
    "unit/runtime/test_precision_config_loss_scale.py",
    "unit/runtime/test_precision_config_dynamic_scale.py",
    "unit/monitor/test_monitor.py",
    "unit/runtime/test_runtime_utils.py",
    "unit/runtime/test_data.py",
    "unit/comm/test_dist.py",
    "unit/utils/test_get_optim_files.py",
    "unit/utils/test_partition_balanced.py",
    "unit/utils/test_init_on_device.py",
    "unit/launcher/test_ds_arguments.py",
    "unit/runtime/activation_checkpointing/test_activation_checkpointing.py::"
    "test_configure_with_contiguous_checkpointing_requires_num_checkpoints",
)

# A pytest plugin (written next to the copied tests) that records each case's outcome as JSON: the
# DistributedTest harness reports a failing rank's exception in the test process, as the call's failure.
_PLUGIN = """
import json, os

_results = {}

def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry.update(outcome="skipped", message=str(reason).removeprefix("Skipped: "))
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        if entry["outcome"] not in ("failed", "error"):
            entry.update(outcome=outcome, message=_first_error(report))

def _first_error(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:300]

def pytest_collectreport(report):
    if report.failed:
        _results[report.nodeid] = {"outcome": "error", "message": "collection: " + " ".join(
            str(report.longrepr).split())[-300:]}

def pytest_sessionfinish(session):
    with open(os.environ["ZEROSHARD_CONFORMANCE_OUT"], "w") as f:
        json.dump(_results, f, indent=1)
"""


def copy_tests(checkout: Path, into: Path) -> Path:
    """``tests/`` of ``checkout`` (a work tree, or a git directory read at HEAD) under ``into``."""
    if (checkout / "tests" / "unit").is_dir():
        shutil.copytree(checkout / "tests", into / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        archive = subprocess.run(
            ["git", f"--git-dir={checkout}", "archive", "HEAD", "tests"], check=True, capture_output=True
        )
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    tests = into / "tests"
    if not (tests / "unit" / "common.py").is_file():
        raise SystemExit(f"{checkout} has no tests/unit/common.py: not a DeepSpeed checkout")
    (tests / "zeroshard_conformance_plugin.py").write_text(textwrap.dedent(_PLUGIN))
    return tests


def checkout_commit(checkout: Path) -> str:
    """The commit of the DeepSpeed checkout whose tests ran ("unknown" when git cannot tell)."""
    where = ["--git-dir", str(checkout)] if not (checkout / "tests").is_dir() else ["-C", str(checkout)]
    proc = subprocess.run(["git", *where, "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def run_side(
    side: str, tests: Path, cases: list[str], timeout: int, tree: Path | None = None
) -> tuple[dict[str, Any], float]:
    """One pytest run of ``cases`` with ``import deepspeed`` giving ``side``; the outcome of each case.
    ``tree``: a zeroshard source tree imported instead of the installed zeroshard."""
    out = tests / f"results-{side}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEROSHARD_AS_DEEPSPEED")}
    env.update(
        DS_ACCELERATOR="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        DS_UNITTEST_TIMEOUT=str(timeout),  # the harness's per-test wait for its workers
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE says how many; the
        # harness skips a world-size-2 case on a machine with fewer "devices".
        LOCAL_SIZE="2",
        # The plugin only (and a zeroshard tree under test); DeepSpeed's conftest adds the copy's root itself.
        PYTHONPATH=os.pathsep.join([str(tree)] * (tree is not None) + [str(tests)]),
        ZEROSHARD_CONFORMANCE_OUT=str(out),
    )
    if side == "zeroshard":
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "zeroshard_conformance_plugin", "-p", "no:cacheprovider"]
    command += ["-q", "--no-header", "-rN", "--continue-on-collection-errors", f"--timeout={timeout + 60}"]
    command += cases
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if not out.is_file():  # pytest itself failed (an import error in conftest, a usage error)
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise SystemExit(f"the {side} run wrote no results (exit {proc.returncode}):\n{tail}")
    return json.loads(out.read_text()), elapsed


def _version(side: str, tree: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZEROSHARD_AS_DEEPSPEED")}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    if side == "zeroshard":
        env["ZEROSHARD_AS_DEEPSPEED"] = "1"
    env["DS_ACCELERATOR"] = "cpu"
    probe = "import warnings; warnings.simplefilter('ignore'); import deepspeed; print(deepspeed.__version__)"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else f"unknown ({proc.stderr[-200:]})"


def _fill_collection_errors(cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Cases one side ran and the other could not collect: the module's collection error, per case (the
    module-level entries themselves are dropped); cases a side did not report at all: "not run"."""
    modules = {name: case for name, case in cases.items() if "::" not in name}
    out = {name: case for name, case in cases.items() if "::" in name}
    for name, case in out.items():
        module = modules.get(name.split("::")[0], {})
        for side in SIDES:
            if side not in case:
                case[side] = module.get(side) or {"outcome": "not run", "message": ""}
    return out


def summarize(cases: dict[str, dict[str, Any]]) -> dict[str, int]:
    def passed(case: dict[str, Any], side: str) -> bool:
        return bool(case.get(side, {}).get("outcome") == "passed")

    return {
        "cases": len(cases),
        "deepspeed_passed": sum(passed(c, "deepspeed") for c in cases.values()),
        "zeroshard_passed": sum(passed(c, "zeroshard") for c in cases.values()),
        "both_passed": sum(passed(c, "deepspeed") and passed(c, "zeroshard") for c in cases.values()),
        "deepspeed_only": sum(passed(c, "deepspeed") and not passed(c, "zeroshard") for c in cases.values()),
        "zeroshard_only": sum(passed(c, "zeroshard") and not passed(c, "deepspeed") for c in cases.values()),
    }


def print_table(cases: dict[str, dict[str, Any]], summary: dict[str, int]) -> None:
    width = max((len(name) for name in cases), default=10)
    print(f"{'case':<{width}}  {'deepspeed':<9}  {'zeroshard':<9}  zeroshard's error")
    for name in sorted(cases):
        ds = cases[name].get("deepspeed", {})
        zs = cases[name].get("zeroshard", {})
        note = zs.get("message", "") if zs.get("outcome") != "passed" else ""
        row = f"{name:<{width}}  {ds.get('outcome', '-'):<9}  {zs.get('outcome', '-'):<9}  {note[:100]}"
        print(row.rstrip())
    print()
    print(
        f"{summary['cases']} cases: DeepSpeed passes {summary['deepspeed_passed']}, zeroshard passes "
        f"{summary['zeroshard_passed']} ({summary['both_passed']} of DeepSpeed's, "
        f"{summary['zeroshard_only']} more); passed by DeepSpeed only: {summary['deepspeed_only']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a DeepSpeed checkout (work tree or git directory)")
    parser.add_argument("--side", choices=("both", *SIDES), default="both", help="which side(s) to run")
    parser.add_argument("--previous", type=Path, help="results JSON whose other side is kept (with --side)")
    parser.add_argument("-k", "--select", default="", help="only the CASES entries containing this text")
    parser.add_argument("--timeout", type=int, default=300, help="seconds one case may take (default 300)")
    parser.add_argument(
        "--zeroshard-tree", type=Path, help="a zeroshard source tree to test instead of the installed one"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS})")
    args = parser.parse_args()

    selected = [c for c in CASES if args.select in c]
    if not selected:  # pytest given no node id would collect all of DeepSpeed's tests
        raise SystemExit(f"-k {args.select!r}: no entry of CASES contains it (a file, class or case id)")
    sides = SIDES if args.side == "both" else (args.side,)
    previous: dict[str, Any] = json.loads(args.previous.read_text()) if args.previous else {}
    cases: dict[str, dict[str, Any]] = {k: dict(v) for k, v in previous.get("cases", {}).items()}
    meta: dict[str, Any] = dict(previous.get("runs", {}))
    with tempfile.TemporaryDirectory(prefix="ds-conformance-") as tmp:
        tests = copy_tests(args.checkout.resolve(), Path(tmp))
        for side in sides:
            print(f"running DeepSpeed's tests against {side} ...", file=sys.stderr, flush=True)
            tree = args.zeroshard_tree if side == "zeroshard" else None
            results, elapsed = run_side(side, tests, selected, args.timeout, tree)
            for nodeid, case in cases.items():  # a rerun replaces this side's outcomes of the selected cases
                if any(nodeid.startswith(sel) for sel in selected):
                    case.pop(side, None)
            for nodeid, outcome in results.items():
                cases.setdefault(nodeid, {})[side] = outcome
            meta[side] = {"version": _version(side, tree), "seconds": round(elapsed, 1)}
    cases = _fill_collection_errors(cases)
    summary = summarize(cases)
    print_table(cases, summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "checkout": str(args.checkout),
        "checkout_commit": checkout_commit(args.checkout.resolve()),
        "runs": meta,
        "summary": summary,
        "cases": cases,
    }
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
