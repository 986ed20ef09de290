"""DeepSpeed's engine methods on zeroshard's engine: the config queries (queries.py) give what a real
DeepSpeed 0.19.8 gives for the same ds_config, the behaviour methods (methods.py) do what
DeepSpeed's do, and every other ``DeepSpeedEngine`` method is refused at use by name.

The comparison builds a real DeepSpeed engine on CPU at W=1 (one process, a gloo group, in a subprocess
without the alias) for each config in ``CONFIGS``, calls every query and prints the answers as JSON; the
same configs then go through ``zeroshard.initialize`` here and must answer the same, method by method,
except for ``KNOWN_DIFFERENCES`` (each with its reason). DeepSpeed's CPU accelerator refuses fp16; the
subprocess tells it fp16 is supported, which only building the engine needs (nothing is trained there).

Run as a script (``python tests/test_engine_queries.py``, real DeepSpeed, DS_ACCELERATOR=cpu) it prints
DeepSpeed's answers.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

CONFIGS: dict[str, dict[str, Any]] = {
    "z0_fp32": {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.5,
        "steps_per_print": 10,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.01, "torch_adam": True},
        },
        "zero_optimization": {"stage": 0},
        "checkpoint": {"tag_validation": "fail", "use_node_local_storage": True},
        "aio": {"block_size": 262144, "queue_depth": 4},
        "dataloader_drop_last": True,
        "prescale_gradients": True,
        "gradient_predivide_factor": 2.0,
    },
    "z2_bf16_offload": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "bf16": {"enabled": True},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "reduce_bucket_size": 1e6,
            "allgather_bucket_size": 2e6,
            "overlap_comm": True,
            "contiguous_gradients": False,
            "round_robin_gradients": True,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 10},
        },
        "flops_profiler": {
            "enabled": True,
            "profile_step": 7,
            "module_depth": 2,
            "top_modules": 3,
            "detailed": False,
        },
        "tensorboard": {"enabled": True, "output_path": "{tmp}", "job_name": "queries"},
        "communication_data_type": "fp32",
    },
    "z3_fp16_offload": {
        "train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {
            "enabled": True,
            "initial_scale_power": 10,
            "loss_scale_window": 50,
            "hysteresis": 3,
            "min_loss_scale": 2,
        },
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": False},
            "stage3_prefetch_bucket_size": 1000,
            "stage3_param_persistence_threshold": 10,
            "stage3_max_live_parameters": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
            "sub_group_size": 1e7,
        },
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 5}},
        "gradient_clipping": 1.5,
        "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": True,
    },
    "z1_static_fp16": {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True, "loss_scale": 128, "auto_cast": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        # Blocks of features zeroshard does not have, off but with settings DeepSpeed reports.
        "data_efficiency": {
            "seed": 42,
            "data_sampling": {"num_workers": 2, "dynamic_batching": {"verbose": 1}},
        },
        "autotuning": {"enabled": False, "metric_path": "/tmp/metric.json", "start_profile_step": 4},
        "compile": {"passes": ["z1"]},
        "torch_autocast": {"enabled": False, "dtype": "bfloat16"},
        "checkpoint": {"tag_validation": "Ignore", "load_universal": False},
    },
}

# Queried besides queries.QUERIES: DeepSpeed's behaviour methods that only read state.
BEHAVIOUR_QUERIES = (
    "optimizer_name",
    "get_mom",
    "get_type",
    "get_lr",
    "get_data_types",
    "was_step_applied",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "zero_optimization",
    "zero_optimization_stage",
    "zero_optimization_partition_gradients",
    "zero_gather_16bit_weights_on_model_save",
    "fp16_enabled",
    "bfloat16_enabled",
)

KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {
    ("*", "compile_zero_optimization_stage"): (
        "DeepSpeed 0.19.8 raises TypeError ('z1' in None) when compile.passes is unset; zeroshard "
        "answers False"
    ),
    **dict.fromkeys(
        [("z2_bf16_offload", "get_data_types"), ("z3_fp16_offload", "get_data_types")],
        "zeroshard accumulates 16-bit gradients over several micro-batches in fp32 (core/precision.py) and "
        "says so; DeepSpeed reports the compute dtype unless data_types.grad_accum_dtype is set",
    ),
}
# Queries whose DeepSpeed answer is a pydantic block: compared on the fields zeroshard's block has.
BLOCKS = {"zero_offload_optimizer", "zero_offload_param", "zenflow_config", "tensor_parallel_config"}
BLOCK_FIELD_DIFFERENCES = {
    ("tensor_parallel_config", "dtype"): "zeroshard keeps AutoTP's dtype unset (None), DeepSpeed fills fp16",
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value)
    if hasattr(value, "model_dump"):  # a pydantic block
        return _jsonable(value.model_dump())
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, bool | int | float | str | type(None)):
        return value
    if hasattr(value, "value") and isinstance(value.value, str):  # an enum (DeepSpeed's offload device)
        return value.value
    return repr(value)


def query_names() -> list[str]:
    from zeroshard.runtime.queries import QUERIES

    return [*QUERIES, *BEHAVIOUR_QUERIES]


def answers(engine: Any) -> dict[str, Any]:
    """Every query's answer as JSON, or ``{"raises": type}``."""
    out: dict[str, Any] = {}
    for name in query_names():
        try:
            out[name] = {"ok": _jsonable(getattr(engine, name)())}
        except Exception as error:
            out[name] = {"raises": type(error).__name__}
    out["communication_data_type"] = {"ok": _jsonable(engine.communication_data_type)}
    out["get_batch_info"] = {"ok": [f() for f in engine.get_batch_info()]}
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def config(name: str, tmp: str) -> dict[str, Any]:
    return json.loads(json.dumps(CONFIGS[name]).replace("{tmp}", tmp))


def deepspeed_answers() -> dict[str, Any]:
    """DeepSpeed's answers for every config (run this module as a script, without the alias)."""
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    tmp = tempfile.mkdtemp()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "zeroshard" in deepspeed.__file__:
        raise RuntimeError(f"expected the real DeepSpeed, imported {deepspeed.__file__}")
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    type(get_accelerator()).is_fp16_supported = lambda self: True  # building the engine only
    out = {}
    for name in CONFIGS:
        net = model()
        engine, *_ = deepspeed.initialize(
            model=net, model_parameters=net.parameters(), config=config(name, tmp), dist_init_required=False
        )
        out[name] = answers(engine)
        engine.destroy()
    return out


def _ds_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROSHARD_AS_DEEPSPEED", "WORLD_SIZE", "RANK")}
    env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def _differences(name: str, theirs: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    found = {}
    for query, their in theirs.items():
        our = ours.get(query, "<missing>")
        if (name, query) in KNOWN_DIFFERENCES or ("*", query) in KNOWN_DIFFERENCES:
            continue
        if query in BLOCKS and "ok" in their and isinstance(our, dict) and isinstance(our.get("ok"), dict):
            fields = {
                f: (their["ok"].get(f, "<missing>"), value)
                for f, value in our["ok"].items()
                if (query, f) not in BLOCK_FIELD_DIFFERENCES and their["ok"].get(f, "<missing>") != value
            }
            if fields:
                found[query] = fields
            continue
        if json.dumps(their, sort_keys=True) != json.dumps(our, sort_keys=True):
            found[query] = {"deepspeed": their, "zeroshard": our}
    return found


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_queries_give_what_deepspeed_gives(tmp_path: Path) -> None:
    import zeroshard

    done = subprocess.run(
        [sys.executable, __file__], env=_ds_env(), capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    mismatched = {}
    for name in CONFIGS:
        net = model()
        engine, *_ = zeroshard.initialize(
            model=net,
            model_parameters=net.parameters(),
            config=config(name, str(tmp_path)),
            dist_init_required=False,
        )
        ours = json.loads(json.dumps(answers(engine)))
        engine.destroy()
        assert set(ours) == set(theirs[name])
        found = _differences(name, theirs[name], ours)
        if found:
            mismatched[name] = found
    assert not mismatched, json.dumps(mismatched, indent=1)[:6000]


# -- the table itself -------------------------------------------------------------------------------------


def test_every_query_is_a_deepspeed_engine_method_of_its_own() -> None:
    """Each entry is a DeepSpeedEngine method, made once on DeepSpeedQueries (nothing else defines it)."""
    from zeroshard import ZeroshardEngine
    from zeroshard.deepspeed.surface import inventory
    from zeroshard.runtime.queries import QUERIES

    methods = inventory()["modules"]["deepspeed.runtime.engine"]["names"]["DeepSpeedEngine"]["methods"]
    for name in QUERIES:
        assert name in methods, name
        owners = [c.__name__ for c in ZeroshardEngine.__mro__ if name in vars(c)]
        assert owners == ["DeepSpeedQueries"], (name, owners)
        method = getattr(ZeroshardEngine, name)
        assert method.__name__ == name and method.__doc__, name
        assert list(inspect.signature(method).parameters) == ["self"], name


def test_the_methods_take_deepspeeds_arguments() -> None:
    """Every DeepSpeedEngine method defined here takes DeepSpeed's parameters, names, order and defaults."""
    from tests.test_deepspeed_surface import signature_problems
    from zeroshard.deepspeed.surface import inventory
    from zeroshard.runtime.methods import DeepSpeedMethods
    from zeroshard.runtime.queries import DeepSpeedQueries

    methods = inventory()["modules"]["deepspeed.runtime.engine"]["names"]["DeepSpeedEngine"]["methods"]
    ours = {name for cls in (DeepSpeedMethods, DeepSpeedQueries) for name in vars(cls) if name in methods}
    assert len(ours) > 120
    problems = {
        name: signature_problems(methods[name], inspect.signature(getattr(DeepSpeedQueries, name)), set())
        for name in sorted(ours)
        if methods[name] != "property"
    }
    # zeroshard writes safetensors, never pickles: the default file name is save_16bit_model's.
    assert problems.pop("save_fp16_model") == [
        "'save_filename' defaults to 'model.safetensors' (DeepSpeed: 'pytorch_model.bin')"
    ]
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}


# -- the behaviour methods --------------------------------------------------------------------------------


def _engine(stage: int, gas: int = 1, optimizer: Any = None, **extra: Any) -> Any:
    import zeroshard
    from tests.models import make_model

    net = make_model()
    zero: dict[str, Any] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        **extra,
    }
    trained = [p for p in net.parameters() if p.requires_grad]
    opt = optimizer(trained) if optimizer is not None else torch.optim.SGD(trained, lr=0.1)
    engine, *_ = zeroshard.initialize(model=net, optimizer=opt, config=cfg, dist_init_required=False)
    return engine


def _window(engine: Any, step: int, micro_batches: int) -> None:
    from tests.models import batch

    for micro in range(micro_batches):
        engine.backward(engine(*batch(step, micro, 0)))
        engine.step()


@pytest.mark.parametrize("stage", [0, 3])
def test_set_train_batch_size_changes_the_accumulation_steps(stage: int) -> None:
    """gas 1 for two steps, then set_train_batch_size(4): two windows of two micro-batches, the same update
    as plain torch (SGD, mean over the window's micro-batches), counters as DeepSpeed's."""
    from tests.models import batch, make_model

    engine = _engine(stage)
    ref = make_model()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    plan = [1, 1, 2, 2]  # micro-batches per optimizer step
    for step, micro_batches in enumerate(plan):
        if step == 2:
            assert engine.was_step_applied()
            engine.set_train_batch_size(4)
            assert [f() for f in engine.get_batch_info()] == [4, 2, 2]
            assert engine.was_step_applied()  # still about the last step()
        _window(engine, step, micro_batches)
        ref_opt.zero_grad()
        for micro in range(micro_batches):
            (ref(*batch(step, micro, 0)) / micro_batches).backward()
        ref_opt.step()
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (4, 12, 8)
    ours = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_set_train_batch_size_refusals() -> None:
    engine = _engine(0)
    with pytest.raises(
        ValueError, match=r"multiple of train_micro_batch_size_per_gpu\(2\) \* world_size\(1\)"
    ):
        engine.set_train_batch_size(3)
    for bad, kind in ((0, ValueError), (True, TypeError), ("4", TypeError)):
        with pytest.raises(kind):
            engine.set_train_batch_size(bad)
    engine.set_train_batch_size(4)
    _window(engine, 0, 1)  # half a window
    with pytest.raises(RuntimeError, match="inside an accumulation window"):
        engine.set_train_batch_size(2)
    _window(engine, 0, 1)
    engine.set_train_batch_size(2)
    assert engine.gradient_accumulation_steps() == 1 and engine.micro_steps == engine.global_steps
    # bf16 without accumulation keeps 16-bit gradient buffers: accumulating in them is refused...
    engine = _engine(2, bf16={"enabled": True})
    with pytest.raises(RuntimeError, match="grad_accum_dtype"):
        engine.set_train_batch_size(4)
    # ... unless the config chose the accumulation dtype, or the engine was built to accumulate.
    _engine(2, bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"}).set_train_batch_size(4)
    engine = _engine(2, gas=2, bf16={"enabled": True})
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    engine.set_train_batch_size(2)
    engine.set_train_batch_size(6)
    assert engine.gradient_accumulation_steps() == 3


def test_set_train_micro_batch_size_keeps_the_accumulation_steps() -> None:
    engine = _engine(1, gas=2)
    engine.set_train_micro_batch_size(3)
    assert [f() for f in engine.get_batch_info()] == [6, 3, 2]
    assert engine.telemetry.train_batch_size == 6
    _window(engine, 0, 2)
    assert engine.global_samples == 6
    with pytest.raises(ValueError):
        engine.set_train_micro_batch_size(0)


def test_was_step_applied() -> None:
    """False before a step, inside a window and after an fp16 overflow; True after an applied step."""
    from tests.models import batch

    engine = _engine(1, gas=2, fp16={"enabled": True, "initial_scale_power": 4})
    assert not engine.was_step_applied()
    _window(engine, 0, 1)
    assert not engine.was_step_applied()
    _window(engine, 0, 1)
    assert engine.was_step_applied()
    for micro in range(2):
        engine.backward(engine(*batch(1, micro, 0)) * float("inf"))
        engine.step()
    assert engine.skipped_steps == 1 and not engine.was_step_applied()
    _window(engine, 2, 2)
    assert engine.was_step_applied()


def test_module_state_dict_and_load() -> None:
    """Stage 0: the module's state dict (prefix, destination, frozen left out); a load round trip, with
    allowed_missing_keys, a custom_load_fn and DeepSpeed's frozen_param_fragments."""
    engine = _engine(0)
    state = engine.module_state_dict()
    assert list(state) == list(engine.module.state_dict())
    assert "frozen.weight" not in engine.module_state_dict(exclude_frozen_parameters=True)
    into: dict[str, Any] = {"other": 1}
    assert engine.module_state_dict(destination=into, prefix="m.") is into and "m.lin1.weight" in into
    saved = {k: v.clone() for k, v in state.items()}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    partial = {k: v for k, v in saved.items() if not k.startswith("frozen.")}
    with pytest.raises(RuntimeError, match=r"missing=\['frozen.weight'\]"):
        engine.load_module_state_dict({"module": partial}, allowed_missing_keys=["frozen.bias"])
    fragments = {k[len("frozen.") :]: v for k, v in saved.items() if k.startswith("frozen.")}
    engine.load_module_state_dict(
        {"module": partial, "frozen_param_fragments": {f"frozen.{k}": v for k, v in fragments.items()}},
        allowed_missing_keys=["frozen.weight", "frozen.bias"],
    )
    for key, value in engine.module.state_dict().items():
        torch.testing.assert_close(value, saved[key], msg=key)
    seen: list[Any] = []
    engine.load_module_state_dict({"module": saved}, custom_load_fn=lambda src, dst: seen.append((src, dst)))
    assert seen == [(saved, engine.module)]
    with pytest.raises(KeyError):
        engine.load_module_state_dict(saved)


def test_optimizer_values_and_small_methods(tmp_path: Path) -> None:
    from torch.utils.data import IterableDataset, TensorDataset

    adam = _engine(0, optimizer=lambda p: torch.optim.Adam(p, betas=(0.8, 0.9)))
    assert (adam.optimizer_name(), adam.get_mom(), adam.get_type()) == ("Adam", [(0.8, 0.9)], [0.0])
    sgd = _engine(0, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5))
    assert (sgd.optimizer_name(), sgd.get_mom()) == ("SGD", [0.5])
    assert sgd.get_data_types() == (torch.float32, torch.float32)
    ranks = (sgd.get_data_parallel_rank(), sgd.get_model_parallel_rank(), sgd.get_tensor_parallel_rank())
    assert ranks == (0, 0, 0)
    assert sgd.communication_data_type == torch.float32
    with pytest.raises(NotImplementedError, match="communication_data_type in the ds_config"):
        sgd.communication_data_type = torch.float16

    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    data = TensorDataset(torch.zeros(3))
    assert sgd.is_map_style_dataset(data) and type(sgd).is_map_style_dataset(data)
    assert not sgd.is_iterable_style_dataset(data) and sgd.is_iterable_style_dataset(Stream())
    assert isinstance(sgd.collect_python_gc(), int)
    assert sgd.save_fp16_model(str(tmp_path)) and (tmp_path / "model.safetensors").exists()


def module_state_worker(rank: int, world_size: int) -> None:
    """ZeRO stage 3 at W=2: module_state_dict gathers full values on every rank, load_module_state_dict
    writes them back into the master shards; set_train_batch_size counts both ranks; the ranks."""
    engine = _engine(3)
    assert engine.get_data_parallel_rank() == rank
    state = engine.module_state_dict()
    full = engine.full_state_dict()
    assert set(state) == set(full)
    for key, value in full.items():
        torch.testing.assert_close(state[key], value, msg=key)
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    engine.load_module_state_dict({"module": zeros})
    assert all(float(v.abs().max()) == 0 for v in engine.full_state_dict().values())
    engine.load_module_state_dict({"module": state})
    for key, value in engine.full_state_dict().items():
        torch.testing.assert_close(value, state[key], msg=key)
    with pytest.raises(NotImplementedError, match="load_checkpoint"):
        engine.load_module_state_dict({"module": state, "frozen_param_fragments": {"frozen.bias": 0}})
    with pytest.raises(ValueError, match=r"world_size\(2\) = 4"):
        engine.set_train_batch_size(6)
    engine.set_train_batch_size(8)
    assert engine.gradient_accumulation_steps() == 2


@pytest.mark.timeout(240)
def test_stage3_module_state_at_two_ranks() -> None:
    from tests.distributed import run_distributed

    run_distributed(module_state_worker, 2)


# -- the rest of DeepSpeedEngine: refused at use ----------------------------------------------------------


def test_every_deepspeed_engine_method_exists_or_is_refused_by_name() -> None:
    from zeroshard import ZeroshardEngine
    from zeroshard.deepspeed.surface import inventory

    methods = inventory()["modules"]["deepspeed.runtime.engine"]["names"]["DeepSpeedEngine"]["methods"]
    engine = _engine(0)
    refused = []
    for name, params in methods.items():
        if hasattr(ZeroshardEngine, name):
            continue
        refused.append(name)
        method = getattr(engine, name)
        assert hasattr(engine, name)  # as on DeepSpeed's engine: the name exists, the call is refused
        required = [p for p in params if p[0] != "self" and p[1] == "POSITIONAL_OR_KEYWORD" and p[2] is None]
        with pytest.raises(
            NotImplementedError, match=rf"DeepSpeedEngine\.{name}\(\).*porting\.md#refused-at-use"
        ):
            method(*[None] * len(required))
    assert "allreduce_gradients" in refused and len(refused) < 40, refused
    signature = inspect.signature(engine.allreduce_bucket)
    assert list(signature.parameters) == ["bucket", "dp_group", "dp_world_size"]
    with pytest.raises(TypeError):  # a call DeepSpeed would reject fails as in DeepSpeed, first
        engine.allreduce_bucket()
    with pytest.raises(AttributeError, match="neither the engine nor its module"):
        engine.not_a_deepspeed_method  # noqa: B018


def test_a_model_attribute_of_the_same_name_still_wins() -> None:
    import zeroshard

    class Net(nn.Linear):
        swap_tensor_config = "the model's setting"

        def allreduce_gradients(self) -> str:
            return "the model's"

    net = Net(3, 2)
    engine, *_ = zeroshard.initialize(
        model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config={"train_batch_size": 1}
    )
    assert engine.allreduce_gradients() == "the model's"
    assert engine.swap_tensor_config == "the model's setting"
    with pytest.raises(NotImplementedError, match=r"DeepSpeedEngine\.sparse_allreduce"):
        engine.sparse_allreduce(None, None)


if __name__ == "__main__":
    print(json.dumps(deepspeed_answers()))
