"""DeepSpeed's utility names that zeroshard writes by hand give what the real DeepSpeed gives.

The cases below run twice on the same inputs: in a subprocess against the real DeepSpeed (no alias,
``DS_ACCELERATOR=cpu``), which prints its results as JSON, and in this process against
``zeroshard.deepspeed``; the two result tables must be equal, exceptions compared by type. The world-size-2
cases (process groups, collectives, the averaged gradient norm) run in two gloo workers on each side.

Where zeroshard deliberately differs, the case is left out here and checked on its own below: DeepSpeed's
``ensure_directory_exists("bare_name")`` fails on the empty directory name, ``get_all_ranks_from_group``
never returns for the world group, the queries that need a process group fail without one, and the
no-ops print in DeepSpeed where zeroshard's library logs or does nothing.

Run as a script (``python tests/test_deepspeed_utils_names.py``) it prints DeepSpeed's table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def _jsonable(value: Any) -> Any:
    if torch.is_tensor(value):
        return {"tensor": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bool, str, type(None))):
        return value
    if isinstance(value, float):
        return value
    if hasattr(value, "__index__"):  # numpy integers
        return int(value)
    return repr(value)


def _attempt(fn: Callable[[], Any]) -> Any:
    """``{"ok": result}`` or ``{"raises": the exception's kind}`` (DeepSpeed's ``assert``: AssertionError)."""
    try:
        return {"ok": _jsonable(fn())}
    except Exception as error:
        kind = "AssertionError" if isinstance(error, AssertionError) else type(error).__name__
        return {"raises": kind}


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    names = ["LOCAL_RANK", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK"]
    names.append("OMPI_COMM_WORLD_SIZE")
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=0)
        self.messages: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append([record.levelno, record.getMessage()])


@contextmanager
def _captured(log: logging.Logger, level: int) -> Iterator[_Records]:
    records, saved = _Records(), log.level
    log.addHandler(records)
    log.setLevel(level)
    try:
        yield records
    finally:
        log.removeHandler(records)
        log.setLevel(saved)


# --- the cases ------------------------------------------------------------------------------------------


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7,), (3, 5), (2,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    params[0].grad[2] = 0.0  # type: ignore[index]
    params[1].grad[0] = 0.0  # type: ignore[index]
    return params


def groups_cases(root: str) -> dict[str, Any]:
    groups = importlib.import_module(f"{root}.utils.groups")
    out: dict[str, Any] = {}
    out["initialize"] = _attempt(lambda: groups.initialize())
    out["initialize_ep2"] = _attempt(lambda: groups.initialize(ep_size=2))
    getters = [
        "get_data_parallel_group",
        "get_data_parallel_rank",
        "get_data_parallel_world_size",
        "get_model_parallel_group",
        "get_model_parallel_rank",
        "get_model_parallel_world_size",
        "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size",
    ]
    for name in getters:
        out[name] = _attempt(getattr(groups, name))
    groups.set_tensor_model_parallel_world_size(4)
    groups.set_tensor_model_parallel_rank(3)
    for name in getters[-5:]:
        out[f"{name}_after_set"] = _attempt(getattr(groups, name))
    groups.set_tensor_model_parallel_world_size(None)
    groups.set_tensor_model_parallel_rank(None)
    out["get_model_parallel_rank_after_unset"] = _attempt(groups.get_model_parallel_rank)
    return out


def logging_cases(root: str, tmp: str) -> dict[str, Any]:
    logs = importlib.import_module(f"{root}.utils.logging")
    log: logging.Logger = logs.logger
    out: dict[str, Any] = {}
    out["get_dist_msg"] = [
        logs.get_dist_msg("hi"),
        logs.get_dist_msg("hi", [0]),
        logs.get_dist_msg("x", [-1]),
    ]
    out["levels"] = [
        _attempt(lambda s=s: logs.get_log_level_from_string(s)) for s in ["INFO", "debug", "nope"]
    ]
    with _captured(log, logging.WARNING) as records:
        out["current_level"] = logs.get_current_level()
        out["should_log_le"] = [_attempt(lambda s=s: logs.should_log_le(s)) for s in ["info", "warning", 3]]
        logs.set_log_level_from_string("info")
        out["current_level_after_set"] = logs.get_current_level()
        out["should_log_le_info_after_set"] = logs.should_log_le("info")
        logs.log_dist("every call", ranks=None, level=logging.WARNING)
        logs.log_dist("listed", ranks=[0])
        for _ in range(2):
            logs.log_dist_once("once", ranks=[0], level=logging.WARNING)
            logs.warning_once("warned once")
            log.warning_once("logger's warned once")
            log.log_dist_once("logger's once", ranks=[1])
        logs.print_configuration(argparse.Namespace(lr=0.1, name="x", a_long_option_name=[1, 2]), "args")
        out["records"] = records.messages
    path = os.path.join(tmp, f"{root}.json")
    logs.print_json_dist({"loss": 1.5}, ranks=[0], path=path)
    with open(path) as f:
        out["print_json_dist"] = json.load(f)
    return out


def comm_utils_cases(root: str) -> dict[str, Any]:
    comm_utils = importlib.import_module(f"{root}.comm.utils")
    names = ["get_local_rank_from_launcher", "get_world_rank_from_launcher", "get_world_size_from_launcher"]
    table: list[dict[str, str]] = [
        {},
        {"LOCAL_RANK": "3", "RANK": "5", "WORLD_SIZE": "8"},
        {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"},
        {"LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "RANK": "7", "OMPI_COMM_WORLD_SIZE": "4"},
        {"LOCAL_RANK": "x", "RANK": "", "WORLD_SIZE": " 2 "},
    ]
    out = []
    for env in table:
        with _environment(**env):
            out.append([_attempt(getattr(comm_utils, name)) for name in names])
    return {"from_launcher": out}


def nvtx_and_device_cases(root: str) -> dict[str, Any]:
    nvtx = importlib.import_module(f"{root}.utils.nvtx")
    init_on_device = importlib.import_module(f"{root}.utils.init_on_device")
    accelerator = importlib.import_module(f"{root}.accelerator.real_accelerator")
    out: dict[str, Any] = {}

    def add(a: int, b: int = 1) -> int:
        return a + b

    def fails() -> None:
        raise KeyError("x")

    out["nvtx"] = [nvtx.instrument_w_nvtx(add)(2, b=5), _attempt(nvtx.instrument_w_nvtx(fails))]

    def made() -> list[Any]:
        linear = torch.nn.Linear(3, 4)
        tensors = [
            torch.Tensor(2, 3),
            torch.Tensor(torch.Size([4])),
            torch.empty(2, dtype=torch.float32),
            torch.zeros(2, dtype=torch.int64),
            torch.ones(2, dtype=torch.bool),
            torch.full((2,), 1.5, device="cpu"),
            torch.full((2,), 7),
            torch.arange(3.0),
            torch.randn(2),
            linear.weight,
            linear.bias,
            torch.nn.Parameter(torch.Tensor(5)),
            torch.nn.LayerNorm(3).weight,
            torch.nn.Embedding(4, 2).weight,
        ]
        return [[str(t.dtype), str(t.device), list(t.shape), type(t).__name__] for t in tensors]

    # DeepSpeed's OnDevice fails on nn.Embedding when torch._dynamo first loads inside the block
    # (test_on_device_in_a_fresh_process); loaded before, both sides compare on the same footing.
    importlib.import_module("torch._dynamo")
    for dtype, device, enabled in [
        (torch.float16, "meta", True),
        (torch.bfloat16, "cpu", True),
        (torch.float16, "meta", False),
        (torch.float64, "meta", True),
    ]:
        with init_on_device.OnDevice(dtype=dtype, device=device, enabled=enabled) as entered:
            out[f"on_device_{dtype}_{device}_{enabled}"] = [made(), entered]
    out["after_on_device"] = made()
    out["is_current_accelerator_supported"] = accelerator.is_current_accelerator_supported()
    return out


def runtime_utils_cases(root: str, tmp: str) -> dict[str, Any]:
    u = importlib.import_module(f"{root}.runtime.utils")
    out: dict[str, Any] = {}
    out["partition_uniform"] = [
        _attempt(lambda a=a, b=b: u.partition_uniform(a, b))
        for a, b in [(10, 3), (3, 5), (0, 2), (7, 7), (100, 7), (5, 1), (13, 4)]
    ]
    weights = [
        ([1, 2, 3, 4, 5, 6, 7], 3),
        ([5, 1, 1, 1, 5], 2),
        ([1] * 10, 4),
        ([3, 1, 4, 1, 5, 9, 2, 6], 4),
        ([1, 2], 3),
        ([0, 0, 0, 1], 2),
        ([2.5, 0.5, 1.0, 3.0], 3),
        ([10, 1, 1, 1, 1, 1, 1, 10, 2, 3, 7], 5),
        ([4, -1, 3, 2], 2),
    ]
    out["partition_balanced"] = [_attempt(lambda w=w, m=m: u.partition_balanced(w, m)) for w, m in weights]
    out["prefix_sum_inc"] = [u.prefix_sum_inc(w) for w in ([3, 4, 5], [], [1.5, 2])]
    norms: list[list[Any]] = [
        [3, 4],
        [3, -1],
        [float("nan")],
        [torch.tensor(3.0), torch.tensor(4.0)],
        [],
        [1e200],
    ]
    out["get_global_norm"] = [_attempt(lambda n=n: u.get_global_norm(n)) for n in norms]
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.tensor([1.0, float("inf")]), (4,), check_invariants=True)
    probes = [
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        torch.tensor([-float("inf")]),
        torch.tensor([1.0, -2.0]),
        torch.empty(0),
        torch.tensor([3, 4]),
        sparse,
        torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    ]
    out["has_inf_or_nan"] = [u.has_inf_or_nan(x) for x in probes]
    marked = []
    for attr, value in [(None, None), ("model_parallel", True), ("tensor_model_parallel", 1)]:
        p = torch.nn.Parameter(torch.zeros(1))
        if attr is not None:
            setattr(p, attr, value)
        marked.append(p)
    off = torch.nn.Parameter(torch.zeros(1))
    off.model_parallel = False  # type: ignore[attr-defined]
    out["is_model_parallel_parameter"] = [u.is_model_parallel_parameter(p) for p in [*marked, off, object()]]
    params = _params(0)
    replicated = _params(1)
    replicated[2].ds_pipe_replicated = True  # type: ignore[attr-defined]
    bad = _params(2)
    bad[1].data[0, 0] = float("nan")
    out["get_weight_norm"] = [
        _attempt(lambda ps=ps, t=t: u.get_weight_norm(ps, norm_type=t))
        for ps in (params, replicated, bad, params[0], [])
        for t in (2, 1, 3.5, float("inf"))
    ]
    no_grad = _params(3)
    no_grad[0].grad = None
    out["get_grad_zeros"] = [u.get_grad_zeros(ps) for ps in (params, replicated, no_grad, params[1])]
    nested = [torch.arange(3), {"a": torch.ones(2, dtype=torch.float16), "b": 7}, (torch.zeros(1), "s")]
    copied = u.copy_to_device(nested, "cpu", torch.is_tensor)
    tensors_only = [torch.arange(3), {"a": torch.ones(2, dtype=torch.float16)}, (torch.zeros(1),)]
    moved = u.move_to_device(tensors_only, "cpu", lambda t: torch.is_tensor(t) and t.is_floating_point())
    out["copy_to_device"] = [copied, copied is nested, copied[0] is nested[0], copied[1]["b"]]
    out["move_to_device"] = [
        moved,
        moved is tensors_only,
        moved[0] is tensors_only[0],
        moved[1]["a"] is tensors_only[1]["a"],
        moved[2][0] is tensors_only[2][0],
    ]
    out["move_to_device_no_criterion"] = [
        _attempt(lambda: u.move_to_device([torch.ones(1), (torch.zeros(2),)], "cpu")),
        _attempt(lambda: u.move_to_device([torch.ones(1), 3], "cpu")),
    ]
    out["get_tensor_bytes"] = [
        u.get_tensor_bytes(x) for x in [nested, torch.ones(3, 2), 5, {"x": [torch.ones(2)]}]
    ]
    tensors = [torch.ones(3), torch.ones(4)]
    for alignment in (4, 7, 1, 16):
        aligned = u.align_dense_tensors(tensors, alignment)
        out[f"align_dense_tensors_{alignment}"] = [aligned, aligned is tensors]
    empty, full = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.ones(2))
    filtered = [
        [empty, full],
        (full, empty),
        [{"params": [empty, full], "lr": 0.1}, {"params": [empty], "lr": 0.2}, {"weight_decay": 0.0}],
        [],
        "not a list",
    ]
    out["filter_empty_parameters"] = [
        [
            {k: ([p.numel() for p in v] if k == "params" else v) for k, v in g.items()}
            if isinstance(g, dict)
            else g
            for g in (r if isinstance(r, list) else [r])
        ]
        for r in (u.filter_empty_parameters(f) for f in filtered)
    ]
    out["call_to_str"] = [
        u.call_to_str("f"),
        u.call_to_str("f", 1, "a"),
        u.call_to_str("g", k=2, s="x"),
        u.call_to_str("h", [1], None, k=(1,)),
    ]
    out["get_only_unique_item"] = [
        _attempt(lambda i=i: u.get_only_unique_item(i)) for i in ([1, 1, 1], [1, 2], [], ("a",))
    ]
    target = os.path.join(tmp, root, "a", "b", "file.pt")
    u.ensure_directory_exists(target)
    u.ensure_directory_exists(target)  # exists already: nothing to do
    out["ensure_directory_exists"] = os.path.isdir(os.path.dirname(target))
    import numpy

    seeded = []
    for seed in (1234, 2**70 + 5):
        u.set_random_seed(seed)
        seeded.append([random.random(), numpy.random.rand(), torch.rand(2)])
    out["set_random_seed"] = seeded

    def f() -> int:
        return 1

    with u.noop_context() as entered:
        out["noop"] = [u.noop_decorator(f) is f, entered]
    out["empty_cache"] = u.empty_cache()
    out["see_memory_usage"] = u.see_memory_usage("unforced")
    out["get_ma_status_is_int"] = isinstance(u.get_ma_status(), int)
    return out


def torch_utils_cases(root: str) -> dict[str, Any]:
    tu = importlib.import_module(f"{root}.utils.torch")
    out: dict[str, Any] = {}
    bounds = [(2.1, None), (None, 1.9), ("2.6", "99"), (99, None), (None, "2.0.1"), ("1.0", None)]
    bounds.append((None, None))
    out["required_torch_version"] = [_attempt(lambda b=b: tu.required_torch_version(*b)) for b in bounds]
    seen: list[Any] = []
    param = torch.nn.Parameter(torch.ones(3))
    handle = tu.register_grad_hook(param, lambda p: seen.append(p.grad.clone()))
    for _ in range(2):
        (param * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    handle.remove()
    (param * 5).sum().backward()
    out["register_grad_hook"] = [seen, param.grad]

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    out["jit_script_compat"] = tu.jit_script_compat(scaled)(torch.arange(3.0))
    inside: list[bool] = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        inside.append(tu.is_functorch_transforming())
        return (x * x).sum()

    torch.func.grad(probe)(torch.ones(2))
    out["is_functorch_transforming"] = [tu.is_functorch_transforming(), inside]
    return out


def throughput_timer_cases(root: str) -> dict[str, Any]:
    """The timer's counters and reports over a run of micro-steps (times vary, so only their signs)."""
    timer_module = importlib.import_module(f"{root}.utils.timer")
    out: dict[str, Any] = {}
    runs = ((True, 2, 2, 3), (True, 0, None, 1), (False, 1, 1, 2))
    for enabled, start_step, per_output, accumulation in runs:
        lines: list[str] = []
        config = argparse.Namespace(enabled=enabled, synchronized=True)
        timer = timer_module.ThroughputTimer(config, 6, start_step, per_output, logging_fn=lines.append)
        trace = [[timer.initialized, timer.started, timer.avg_samples_per_sec()]]
        timer.stop()
        for micro in range(4 * accumulation):
            timer.start()
            timer.stop(global_step=(micro + 1) % accumulation == 0)
            measured = [timer.total_elapsed_time > 0, timer.step_elapsed_time > 0, timer.end_time > 0]
            trace.append([timer.micro_step_count, timer.global_step_count, *measured, len(lines)])
        timer.update_epoch_count()
        average = timer.avg_samples_per_sec()
        trace.append([timer.epoch_count, timer.micro_step_count, average > 0, average == float("-inf")])
        trace.append([line.split(", Running")[0] for line in lines])
        out[f"run_{enabled}_{start_step}_{per_output}_{accumulation}"] = trace
    return out


def config_utils_cases(root: str) -> dict[str, Any]:
    """A config model built on DeepSpeed's base class: aliases, "auto", refused values and keys, and
    deprecated fields moved to their replacement (also in a nested model)."""
    from pydantic import Field, ValidationError

    cu = importlib.import_module(f"{root}.runtime.config_utils")

    class Inner(cu.DeepSpeedConfigModel):  # type: ignore[misc,name-defined]
        size: int = 1

    class Conf(cu.DeepSpeedConfigModel):  # type: ignore[misc,name-defined]
        count: int = 0
        names_old: str | None = Field(
            None, json_schema_extra={"deprecated": True, "new_param": "names", "new_param_fn": lambda x: [x]}
        )
        names: list[str] | None = None
        width: int = Field(3, alias="width_alias")
        inner: Inner = Field(default_factory=Inner)
        size_old: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "inner.size"})
        quiet_old: int = Field(0, json_schema_extra={"deprecated": True, "deprecated_msg": "gone"})

    def made(**data: Any) -> Any:
        try:
            return Conf(**data).model_dump()
        except ValidationError:
            return "ValidationError"
        except AssertionError:
            return "AssertionError"

    out: dict[str, Any] = {}
    inputs: list[dict[str, Any]] = [
        {"count": 42},
        {"names_old": "DS"},
        {"width": 10},
        {"width_alias": 11},
        {"count": "auto"},
        {"size_old": 7},
        {"quiet_old": 2},
        {"count": "DS"},
        {"names": "DS"},
        {"count_typo": 0},
        {"names": ["DS"], "names_old": "DS"},
        {"size_old": 7, "inner": {"size": 2}},
    ]
    out["models"] = [made(**data) for data in inputs]
    conf = Conf()
    try:
        conf.count = "x"  # type: ignore[assignment]
        out["assignment"] = conf.count
    except ValidationError:
        out["assignment"] = "ValidationError"
    out["strict_auto"] = _attempt(lambda: Conf(strict=True, count="auto").count)
    out["defaults"] = [
        _attempt(lambda n=n: cu.get_config_default(Conf, n)) for n in ("count", "width", "nope")
    ]
    out["pp_int"] = [repr(cu.pp_int(1234567)), repr(cu.pp_int(5, "five")), cu.pp_int(12) + 1]
    out["params"] = [cu.get_scalar_param({"a": 1}, "a", 0), cu.get_list_param({}, "b", [2])]
    out["params"].append(cu.get_dict_param({"c": {"d": 1}}, "c", {}))
    pairs = [[("a", 1), ("b", 2)], [("a", 1), ("b", 2), ("a", 3), ("b", 4)]]
    out["duplicates"] = [_attempt(lambda p=p: cu.dict_raise_error_on_duplicate_keys(p)) for p in pairs]
    return out


def zero_config_cases(root: str) -> dict[str, Any]:
    """DeepSpeedZeroConfig built from keyword blocks: deprecated keys, stage3_ aliases, the offload blocks,
    overlap_comm's default, "auto", refused values and assignment. Compared field by field (the two models
    hold different sets of DeepSpeed-internal fields)."""
    from pydantic import ValidationError

    zc = importlib.import_module(f"{root}.runtime.zero.config")
    fields = ["stage", "overlap_comm", "prefetch_bucket_size", "param_persistence_threshold"]
    fields += ["max_reuse_distance", "gather_16bit_weights_on_model_save", "reduce_bucket_size"]
    fields += ["pipeline_loading_checkpoint", "elastic_checkpoint", "contiguous_gradients"]

    def shown(data: dict[str, Any]) -> Any:
        try:
            conf = zc.DeepSpeedZeroConfig(**data)
        except ValidationError:
            return "ValidationError"
        except AssertionError:
            return "AssertionError"
        out = {name: getattr(conf, name) for name in fields}
        for name in ("offload_param", "offload_optimizer"):
            block = getattr(conf, name)
            out[name] = None if block is None else [type(block).__name__, block.device, block.pin_memory]
        out["pipeline"] = None if conf.offload_optimizer is None else conf.offload_optimizer.pipeline
        return out

    inputs: list[dict[str, Any]] = [{}, {"stage": 3}, {"stage": 2, "overlap_comm": True}]
    inputs += [{"cpu_offload": True}, {"cpu_offload": False}]
    # cpu_offload_use_pin_memory: false is left out: DeepSpeed ignores it, zeroshard applies it to the
    # blocks cpu_offload/cpu_offload_param make (config/deprecated.py).
    inputs += [{"cpu_offload_param": True, "cpu_offload_use_pin_memory": True}]
    inputs += [{"stage3_gather_fp16_weights_on_model_save": True}, {"stage3_prefetch_bucket_size": 12345}]
    inputs += [{"stage3_param_persistence_threshold": 7, "stage3_max_reuse_distance": 9}]
    inputs += [{"offload_param": None, "offload_optimizer": None}]
    inputs += [{"offload_param": {}, "offload_optimizer": {}}]
    inputs += [{"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "pipeline_read": True}}]
    inputs += [{"stage": 3, "elastic_checkpoint": True}, {"reduce_bucket_size": "auto"}, {"stage": 9}]
    inputs += [{"stage": "one"}, {"no_such_key": 1}]
    inputs += [{"cpu_offload": True, "offload_optimizer": {"device": "cpu"}}]
    both_gather = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")
    inputs += [dict.fromkeys(both_gather, True)]
    out: dict[str, Any] = {"configs": [shown(data) for data in inputs]}
    conf = zc.DeepSpeedZeroConfig(stage=1)
    conf.stage = 3
    out["assigned"] = conf.stage
    out["from_ds_config"] = [shown({}) == shown({})]
    for ds_config in ({"zero_optimization": True}, {"zero_optimization": {"stage": 2}}, {}):
        out["from_ds_config"].append(zc.get_zero_config(ds_config).stage)
    out["stages"] = [int(zc.ZeroStageEnum.weights), zc.ZeroStageEnum(2).name, zc.ZeroStageEnum.max_stage == 3]
    pc = importlib.import_module(f"{root}.runtime.precision_config")
    blocks: list[dict[str, Any]] = [{}, {"bf16": {"enabled": True}}, {"bfloat16": {"enabled": True}}]
    blocks += [{"bf16": {"check_grad_overflow": False}, "bfloat16": {"enabled": True}}]
    blocks += [{"bf16": {"enabled": "auto"}}, {"bf16": {"enabled": "yes please"}}, {"bf16": {"typo": 1}}]
    out["bf16"] = [_attempt(lambda b=b: pc.get_bfloat16_config(b).model_dump()) for b in blocks]
    halves: list[dict[str, Any]] = [{}, {"fp16": {"enabled": True, "initial_scale_power": 8}}]
    halves += [{"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 4}}, {"fp16": {"loss_scale": -1}}]
    fp16 = [pc.get_float16_config(h) for h in halves[:3]]
    out["fp16"] = [[c.enabled, c.loss_scale, c.initial_dynamic_scale()] for c in fp16]
    out["fp16_args"] = [c.dynamic_loss_scale_args() for c in fp16]
    out["fp16_refused"] = _attempt(lambda: pc.get_float16_config(halves[3]))
    bounds: list[dict[str, Any]] = [
        {"enabled": True, "loss_scale_window": 0},
        {"enabled": True, "min_loss_scale": -1},
    ]
    bounds += [{"enabled": True, "loss_scale": 128, "min_loss_scale": -1}, {"loss_scale_window": 0}]
    out["fp16_dynamic_bounds"] = [
        _attempt(lambda b=b: pc.get_float16_config({"fp16": b}).min_loss_scale) for b in bounds
    ]
    assigned = pc.DeepSpeedBF16Config()
    assigned.enabled = True
    out["bf16_assigned"] = assigned.enabled
    return out


def config_and_monitor_cases(root: str) -> dict[str, Any]:
    """``DeepSpeedConfig``'s derived attributes and the monitor config."""
    rc = importlib.import_module(f"{root}.runtime.config")
    mc = importlib.import_module(f"{root}.monitor.config")
    configs: list[dict[str, Any]] = [{"train_batch_size": 2}]
    configs += [
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.5,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "tensorboard": {"enabled": True, "output_path": "tb/", "job_name": "j"},
            "wandb": {"group": "g", "team": "t", "project": "p"},
            "csv_monitor": {"enabled": False, "output_path": "csv/"},
        },
        {
            "train_batch_size": 8,
            "fp16": {"enabled": True, "loss_scale": 128},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    ]

    def derived(data: dict[str, Any]) -> dict[str, Any]:
        c = rc.DeepSpeedConfig(data)
        m = c.monitor_config
        return {
            "batch": [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps],
            "zero": [c.zero_enabled, c.zero_optimization_stage, c.zero_config.stage],
            "persistence": c.zero_config.param_persistence_threshold,
            "precision": [c.float16_config.enabled, c.float16_config.loss_scale, c.bfloat16_config.enabled],
            "optimizer": [c.optimizer_name, c.optimizer_params, c.scheduler_name, c.scheduler_params],
            "clipping": c.gradient_clipping,
            "world": [c.world_size, c.global_rank],
            "monitor": [m.enabled, m.tensorboard.enabled, m.tensorboard.output_path, m.tensorboard.job_name],
            "wandb": [m.wandb.enabled, m.wandb.group, m.wandb.team, m.wandb.project],
            "csv": [m.csv_monitor.enabled, m.csv_monitor.output_path, m.csv_monitor.job_name],
        }

    out: dict[str, Any] = {"configs": [derived(c) for c in configs]}
    batch_config = rc.DeepSpeedConfig({"train_batch_size": 32})

    def batch(triad: tuple[int | None, ...]) -> Any:
        names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        for name, value in zip(names, triad, strict=True):
            setattr(batch_config, name, value)
        batch_config._configure_train_batch_size()
        return [getattr(batch_config, name) for name in names]

    triads = [(32, 16, None), (32, None, 2), (None, 16, 2), (32, None, None), (None, 8, None)]
    triads += [(33, 17, 2), (32, 18, 1), (None, None, 2), (32, 16, 2)]
    out["batch"] = [_attempt(lambda t=t: batch(t)) for t in triads]
    defaults: Any = mc.DeepSpeedMonitorConfig()
    out["defaults"] = [defaults.enabled, defaults.tensorboard.job_name, defaults.wandb.project]
    out["get"] = mc.get_monitor_config({"csv_monitor": {"enabled": True}}).enabled
    return out


def numa_cases(root: str) -> dict[str, Any]:
    """The core-list syntax of ``--bind_core_list``."""
    numa = importlib.import_module(f"{root}.utils.numa")
    lists = ["0,2-4,6,8-9", "7", " 5", "3-3", "0,2-6,5-9", "8,2-6", "2-6,1", "a", "1-2-3", "5-3", "-1", "1-x"]
    return {"parse_range_list": [_attempt(lambda text=text: numa.parse_range_list(text)) for text in lists]}


def local_cases(root: str) -> dict[str, Any]:
    """Every single-process case against DeepSpeed module tree ``root`` (``deepspeed`` or
    ``zeroshard.deepspeed``)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _jsonable(
            {
                "groups": groups_cases(root),
                "logging": logging_cases(root, tmp),
                "comm_utils": comm_utils_cases(root),
                "nvtx_device": nvtx_and_device_cases(root),
                "runtime_utils": runtime_utils_cases(root, tmp),
                "torch_utils": torch_utils_cases(root),
                "throughput_timer": throughput_timer_cases(root),
                "config_utils": config_utils_cases(root),
                "zero_config": zero_config_cases(root),
                "config_and_monitors": config_and_monitor_cases(root),
                "numa": numa_cases(root),
            }
        )


def monitor_cases(root: str, rank: int) -> dict[str, Any]:
    """The CSV monitor and ``MonitorMaster`` writing events, rank 0 only (values as floats: zeroshard
    writes every value as a float, DeepSpeed as given); a disabled TensorBoard monitor."""
    mc = importlib.import_module(f"{root}.monitor.config")
    mon = importlib.import_module(f"{root}.monitor.monitor")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        writer = mon.csvMonitor(mc.CSVConfig(enabled=True, output_path=tmp, job_name="job"))
        events = [("Train/Samples/train_loss", 1.5, 8), ("Train/Samples/lr", 0.25, 8)]
        writer.write_events(events)
        writer.write_events([("Train/Samples/train_loss", 1.25, 16)])
        where = Path(tmp, "job")
        out["csv_files"] = {f.name: f.read_text() for f in sorted(where.glob("*"))}
        out["csv_attrs"] = [writer.log_dir and os.path.relpath(writer.log_dir, tmp), writer.filenames]
        blocks = {"csv_monitor": {"enabled": True, "output_path": tmp}}
        master = mon.MonitorMaster(mc.get_monitor_config(blocks))
        master.write_events([("Eval/acc", 0.5, 3)])
        written = Path(tmp, "DeepSpeedJobName", "Eval_acc.csv")
        out["master"] = [master.enabled, written.read_text() if written.exists() else None]
    off = mon.TensorBoardMonitor(mc.TensorBoardConfig())
    off.write_events(events)
    out["tb_off"] = [off.enabled, off.summary_writer is None, off.output_path, off.job_name]
    return out


def dist_cases(root: str, rank: int, world_size: int) -> dict[str, Any]:
    """The cases that need a process group of ``world_size`` (gloo, already initialized); every rank runs
    them."""
    comm = importlib.import_module(f"{root}.comm")
    groups = importlib.import_module(f"{root}.utils.groups")
    u = importlib.import_module(f"{root}.runtime.utils")
    logs = importlib.import_module(f"{root}.utils.logging")
    out: dict[str, Any] = {}
    both, second = comm.new_group([0, 1]), comm.new_group([1])
    out["get_all_ranks_from_group"] = [comm.get_all_ranks_from_group(g) for g in (None, both, second)]
    t = torch.tensor([rank + 1.0, 2.0 * rank])
    result = comm.inference_all_reduce(t)
    out["inference_all_reduce"] = [t, result is t, result is None]
    out["configure"] = comm.configure(enabled=False, verbose=False)  # DeepSpeed's comms log stays off
    out["log_summary"] = comm.log_summary()
    summary = comm.log_summary(show_straggler=True, return_dict=True)
    summary["metadata"].pop("timestamp")
    out["log_summary_dict"] = summary
    out["get_data_parallel_group"] = _attempt(groups.get_data_parallel_group)
    src = []
    for size in (1, 2):
        groups.set_tensor_model_parallel_world_size(size)
        src.append(groups.get_tensor_model_parallel_src_rank())
    groups.set_tensor_model_parallel_world_size(None)
    out["get_tensor_model_parallel_src_rank"] = src
    out["get_dist_msg"] = [logs.get_dist_msg("m", r) for r in (None, [], [0], [1], [-1], [5, 1])]
    clipped = []
    for norm_type, max_norm in ((2, 1.0), (2, 1e6), (1, 0.5), (float("inf"), 0.1), (3.5, 2.0)):
        params = _params(10 + rank)
        params[2].grad = None
        total = u.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        clipped.append([total, [p.grad for p in params]])
    out["clip_grad_norm_"] = clipped
    status = u.get_ma_status()
    out["get_ma_status"] = status == 0 if rank else isinstance(status, int)
    out["monitors"] = monitor_cases(root, rank)
    return out


# --- the two sides --------------------------------------------------------------------------------------


def _deepspeed_worker(rank: int, world_size: int, init_file: str, results: Any) -> None:
    try:
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        import deepspeed

        # On the CPU DeepSpeed's backend compiles and starts a shared-memory all-reduce kernel; without it
        # (as where the CPU lacks the kernel's ISA) its collectives are the process group's, as here.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        results.put((rank, json.dumps(_jsonable(dist_cases("deepspeed", rank, world_size)))))
        deepspeed.comm.barrier()
        torch.distributed.destroy_process_group()
    except BaseException as error:
        results.put((rank, json.dumps({"worker_error": repr(error)})))
        raise


def deepspeed_table() -> dict[str, Any]:
    """DeepSpeed's results (run this module as a script, without the alias)."""
    import deepspeed
    import torch.multiprocessing as mp

    if "zeroshard" in deepspeed.__file__:
        raise RuntimeError(f"expected the real DeepSpeed, imported {deepspeed.__file__}")
    table: dict[str, Any] = {"local": local_cases("deepspeed")}
    ctx = mp.get_context("fork")  # the workers inherit the imported DeepSpeed (a spawn re-imports it)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_deepspeed_worker, args=(r, WORLD, init_file, results)) for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        found = dict(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    table["dist"] = [json.loads(found[r]) for r in range(WORLD)]
    return table


def zeroshard_worker(rank: int, world_size: int) -> Any:
    return _jsonable(dist_cases("zeroshard.deepspeed", rank, world_size))


def _deepspeed_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "WORLD_SIZE", "RANK")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_utility_names_give_what_deepspeed_gives() -> None:
    from tests.distributed import run_distributed

    done = subprocess.run(
        [sys.executable, __file__],
        env=_deepspeed_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = json.loads(
        json.dumps(
            {
                "local": local_cases("zeroshard.deepspeed"),
                "dist": run_distributed(zeroshard_worker, WORLD, timeout=120),
            }
        )
    )
    for part in ("local", "dist"):
        mismatched = {
            f"{part}.{section}.{key}": {"deepspeed": value, "zeroshard": ours_section.get(key, "<missing>")}
            for section, their_section in (
                theirs[part].items() if part == "local" else enumerate(theirs[part])
            )
            for ours_section in [ours[part][section]]
            for key, value in their_section.items()
            if ours_section.get(key, "<missing>") != value
        }
        assert not mismatched, json.dumps(mismatched, indent=1)[:6000]


def test_where_zeroshard_differs_on_purpose(tmp_path: Path) -> None:
    """Where DeepSpeed fails or cannot be compared: checked on zeroshard alone."""
    import zeroshard.deepspeed as deepspeed
    from zeroshard.deepspeed import surface
    from zeroshard.deepspeed.runtime import utils as u

    # A bare file name: DeepSpeed's makedirs("") raises; there is no directory to make.
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        u.ensure_directory_exists("bare_name.pt")
    finally:
        os.chdir(cwd)
    # Model parallelism (an mpu) is refused by name.
    params = _params(0)
    for call in (
        lambda: u.clip_grad_norm_(params, 1.0, mpu=object()),
        lambda: u.get_weight_norm(params, mpu=object()),
        lambda: u.get_grad_zeros(params, mpu=object()),
    ):
        with pytest.raises(NotImplementedError, match="model parallelism"):
            call()
    # Without a process group: one rank of one (DeepSpeed's need init_distributed first).
    grads = [p.grad.clone() for p in params if p.grad is not None]
    total = u.clip_grad_norm_(params, 1.0)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    torch.testing.assert_close(total, expected)
    assert u.get_ma_status() >= 0
    with pytest.raises(RuntimeError, match="no process group"):
        deepspeed.comm.get_all_ranks_from_group()
    # The no-ops are marked as accepted; the implemented names are not.
    assert surface.kind_of(u.memory_status) == "accepted"
    assert surface.kind_of(deepspeed.comm.configure) == "accepted"
    assert surface.kind_of(deepspeed.comm.log_summary) == "accepted"
    assert surface.kind_of(u.see_memory_usage) == "implemented"
    assert u.memory_status("m") is None
    # DeepSpeed's names for them resolve to the hand-written objects.
    assert deepspeed.comm.comm.get_all_ranks_from_group is deepspeed.comm.get_all_ranks_from_group
    assert deepspeed.accelerator.is_current_accelerator_supported is (
        deepspeed.accelerator.real_accelerator.is_current_accelerator_supported
    )
    # A forced memory report logs on rank 0 (DeepSpeed prints it).
    with _captured(deepspeed.utils.logger, logging.INFO) as records:
        u.see_memory_usage("forced", force=True)
    assert records.messages[0] == [logging.INFO, "forced"]
    assert any(m.startswith("MA ") for _, m in records.messages)


def test_on_device_in_a_fresh_process() -> None:
    """nn.Embedding on meta where torch._dynamo is not loaded yet (DeepSpeed's OnDevice fails there)."""
    probe = (
        "import sys, torch\n"
        "from zeroshard.deepspeed.utils.init_on_device import OnDevice\n"
        "with OnDevice(dtype=torch.float16, device='meta'):\n"
        "    w = torch.nn.Embedding(4, 2).weight\n"
        "print(w.dtype, w.device)\n"
    )
    env = {**_deepspeed_env(), "ZEROSHARD_AS_DEEPSPEED": "0"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["torch.float16", "meta"]


def test_on_device_nests_and_restores() -> None:
    from zeroshard.deepspeed.utils.init_on_device import OnDevice

    had_own_new = "__new__" in torch.Tensor.__dict__
    with OnDevice(dtype=torch.float16, device="meta"):
        with OnDevice(dtype=torch.bfloat16, device="cpu"):
            inner = [torch.Tensor(2), torch.empty(2)]
        outer = [torch.Tensor(2), torch.empty(2)]
        with pytest.raises(KeyError), OnDevice(dtype=torch.float64, device="cpu"):
            raise KeyError("left by an exception")
        after_raise = torch.zeros(1)
    assert [(t.dtype, t.device.type) for t in inner] == [(torch.bfloat16, "cpu")] * 2
    assert [(t.dtype, t.device.type) for t in outer] == [(torch.float16, "meta")] * 2
    assert (after_raise.dtype, after_raise.device.type) == (torch.float16, "meta")
    assert ("__new__" in torch.Tensor.__dict__) == had_own_new
    assert torch.Tensor(1).device.type == "cpu" and torch.empty(1).dtype == torch.float32
    # Data given to the legacy constructor (DeepSpeed's OnDevice fails on it) is moved and cast.
    with OnDevice(dtype=torch.float16, device="meta"):
        data = torch.Tensor([1.0, 2.0])
    assert (data.dtype, data.device.type, tuple(data.shape)) == (torch.float16, "meta", (2,))


if __name__ == "__main__":
    print(json.dumps(deepspeed_table()))
