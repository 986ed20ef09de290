"""The CUDA paths: NCCL, parameters on the GPU, pinned CPU offload beside the GPU, 16-bit kernels on the GPU.

Skipped without a GPU (CI has none; run on a GPU machine with ``pytest tests/test_cuda.py``). One NCCL
process at world size 1 (NCCL needs one GPU per rank) runs every sub-case. The standard check is parity:

* fp32, every stage, against single-process training of the same model on the same GPU, with the same torch
  optimizer class: at world size 1 the NCCL reductions are the identity, so the only difference left is the
  order of the optimizer's arithmetic over one flat tensor instead of per-parameter tensors (a few fp32 ulps,
  allowed as 1e-6 relative to the parameter plus 1e-7).
* ZeRO-Offload (``offload_optimizer.device: cpu``) and NVMe offload against the same run in GPU memory: the
  step runs on the CPU on pinned fp32 masters. CPU and GPU kernels round differently in the last ulp (fused
  multiply-add): in fp32, 1e-5 of the parameter's size plus 1e-6 after three steps; in bf16 an ulp of a
  master can flip the rounding of its bf16 copy, so the mixed-precision tolerance below.
* bf16 and fp16 at every stage against the same recipe by hand (fp32 masters, 16-bit compute), with the
  tolerance of tests/test_mixed_precision.py (3% of the reference's movement plus 1% of lr per step).
* ZeRO-Infinity's parameter offload (``offload_param.device: cpu``, stage 3, bf16), with and without the
  optimizer offloaded too, against the same run with the parameters in GPU memory (the mixed-precision
  tolerance); between steps every stage-3 unit's 16-bit shard is in pinned CPU memory and no GPU memory holds
  it; ``zero.Init(remote_device="cpu", config_dict_or_path=...)`` builds the model with its partitions in CPU
  memory, ``initialize`` never has it whole on the GPU, and it trains to the same result.
"""

from __future__ import annotations

import copy
import gc
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.distributed import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

VOCAB, WIDTH, STEPS, LR = 50, 64, 3, 1e-2


class _Report(dict[str, Any]):
    """A worker's figures, each also printed as it is recorded: a run stopped by its time limit (one try on
    a lent GPU) still shows how far it got and what it measured."""

    def __setitem__(self, key: str, value: Any) -> None:
        print(f"[cuda] {key}: {value}", flush=True)
        super().__setitem__(key, value)


class Block(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class TinyLM(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randint(0, VOCAB, (4, 16), generator=g)
    return x.cuda(), torch.randint(0, VOCAB, (4, 16), generator=g).cuda()


def _config(stage: int, precision: str = "fp32", gas: int = 1, clip: float = 0.0, **zero: Any) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000, **zero},
    }
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=100)
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    return config


def _train(config: dict, steps: int = STEPS, model: nn.Module | None = None) -> tuple[Any, dict]:
    model = model if model is not None else _model()
    engine, _opt, _, _ = zeroshard.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config
    )
    for step in range(steps):
        for micro in range(config["gradient_accumulation_steps"]):
            engine.backward(engine(*_batch(step, micro)))
            engine.step()
    return engine, _masters(engine)


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master values at world size 1 (the whole parameter), on the CPU."""
    out: dict[str, torch.Tensor] = {}
    with engine.offload.resident(write_back=False):
        for sl in engine.sharded_step.slices:
            name = sl.unit.names[sl.piece.index]
            out[name] = sl.master.detach().float().cpu().clone()
    return out


def _reference(precision: str, gas: int = 1, clip: float = 0.0) -> dict[str, torch.Tensor]:
    """Single-process training on the GPU: fp32, or fp32 masters with a 16-bit compute copy."""
    master = _model().cuda()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    compute = copy.deepcopy(master).to(dtype) if dtype else master
    opt = torch.optim.AdamW(master.parameters(), lr=LR)
    scale = 2.0**8 if precision == "fp16" else 1.0
    for step in range(STEPS):
        for micro in range(gas):
            (compute(*_batch(step, micro)) * scale / gas).backward()
        if compute is not master:
            for p, q in zip(master.parameters(), compute.parameters(), strict=True):
                p.grad = None if q.grad is None else q.grad.float() / scale
                q.grad = None
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(master.parameters()), clip)
        opt.step()
        opt.zero_grad()
        if compute is not master:
            with torch.no_grad():
                for p, q in zip(compute.parameters(), master.parameters(), strict=True):
                    p.copy_(q)
    return {n: p.detach().float().cpu().reshape(-1) for n, p in master.named_parameters()}


def _flat(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.reshape(-1) for n, t in masters.items()}


def _close(got: dict, want: dict, rel: float, abs_: float, what: str) -> float:
    assert set(got) <= set(want), f"{what}: unexpected names {set(got) - set(want)}"
    worst = 0.0
    for name, value in _flat(got).items():
        ref = want[name][: value.numel()]
        err = float((value - ref).abs().max())
        bound = rel * float(ref.abs().max()) + abs_
        assert err <= bound, f"{what}: {name} differs by {err:.3g} (allowed {bound:.3g})"
        worst = max(worst, err)
    return worst


def _moved_bound(got: dict, want: dict, init: dict, step_count: int, what: str) -> None:
    for name, value in _flat(got).items():
        ref = want[name][: value.numel()]
        moved = float((ref - init[name][: value.numel()]).abs().max())
        err = float((value - ref).abs().max())
        assert err <= 0.03 * moved + 0.01 * LR * step_count, f"{what}: {name} differs by {err:.3g}"


def _gpu_state_bytes(engine: Any) -> int:
    """Bytes of the engine's model state in GPU memory: full buffers, masters, gradients, optimizer state
    (each storage once)."""
    tensors = [t for u in engine.units for t in (u.full, u.master, u.grad_full) if t is not None]
    tensors += [u.grad_shard for u in engine.units if u.holds_grad_shard]
    tensors += [v for s in engine.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


# -- ZeRO-Infinity's parameter offload beside a GPU ------------------------------------------------------

WIDE = {"width": 512, "depth": 8}  # 16.8M parameters: 34 MB in bf16, each unit (one module) at most 2 MB


def _on_cpu() -> dict[str, Any]:
    return {"device": "cpu", "pin_memory": True}


def _wide_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**WIDE)


def _sharded_units(engine: Any) -> list[Any]:
    """The stage-3 units whose parameters are sharded between uses (not the persistent small ones)."""
    units = [u for u in engine.units if u.plan.shard_parameters]
    assert units, "no stage-3 unit shards its parameters"
    return units


def _assert_parameters_on_cpu(engine: Any, what: str) -> None:
    """Between steps: each sharded unit's parameters are empty placeholders and the parameter shard its store
    keeps is 16-bit and in pinned CPU memory (``held_param_shard``: ``unit.param_shard`` would start the copy
    a gather needs)."""
    for unit in _sharded_units(engine):
        assert unit.full.numel() == 0, f"{what}: unit {unit.names} is still gathered between steps"
        assert all(p.numel() == 0 for p in unit.params), f"{what}: {unit.names} are not placeholders"
        shard = unit.store.held_param_shard()
        where = None if shard is None else (shard.device.type, shard.is_pinned(), shard.dtype)
        assert where == ("cpu", True, torch.bfloat16), f"{what}: {unit.names} parameter shard: {where}"


def _parameter_residue(engine: Any, base: int) -> tuple[int, int]:
    """GPU bytes held between steps that are none of the model state the config leaves on the GPU (masters,
    optimizer state, gradients, persistent units), and the bytes of the 16-bit parameter shards: with the
    parameters offloaded the first must be a small fraction of the second. ``base``: ``memory_allocated``
    before the model existed."""
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    shards = sum(u.layout.shard_size for u in _sharded_units(engine)) * torch.bfloat16.itemsize
    return held - _gpu_state_bytes(engine), shards


def offload_param_worker(rank: int, world_size: int) -> tuple[dict[str, float], list[str]]:
    """The sub-cases of ``offload_param.device: cpu``; returns the figures and every failed check (all of them
    run: one GPU run shows every problem)."""
    report = _Report()
    failures: list[str] = []
    init = {n: p.detach().float().reshape(-1) for n, p in _model().named_parameters()}

    # Parity with the parameters in GPU memory: offload_param alone (masters and Adam state stay on the GPU,
    # the step writes the 16-bit values into the pinned shard), with the optimizer offloaded too (the CPU
    # step writes them), in sub-groups, with accumulation and clipping.
    cases: list[tuple[str, dict[str, Any]]] = [
        ("offload_param", {}),
        ("offload_param + offload_optimizer", {"offload_optimizer": _on_cpu()}),
        (
            "offload_param + offload_optimizer, sub-groups",
            {"offload_optimizer": _on_cpu(), "sub_group_size": 3000},
        ),
    ]
    for what, base in cases:
        for gas, clip in ((1, 0.0), (2, 0.05)):
            name = f"{what}, gas {gas}"
            try:
                _, in_gpu = _train(_config(3, "bf16", gas=gas, clip=clip, **copy.deepcopy(base)))
                config = _config(
                    3, "bf16", gas=gas, clip=clip, offload_param=_on_cpu(), **copy.deepcopy(base)
                )
                engine, got = _train(config)
                _assert_parameters_on_cpu(engine, name)
                _moved_bound(got, _flat(in_gpu), init, STEPS, name)
            except AssertionError as err:
                failures.append(str(err))
            engine = None

    # zero.Init(remote_device="cpu"): the partitions are built in CPU memory and train to the same result.
    for what, base in cases[:2]:
        try:
            config = _config(3, "bf16", offload_param=_on_cpu(), **copy.deepcopy(base))
            with zeroshard.zero.Init(remote_device="cpu", config_dict_or_path=copy.deepcopy(config)):
                model = _model()
            for name, p in model.named_parameters():
                assert p.numel() == 0 and p.ds_tensor.device.type == "cpu", f"zero.Init {what}: {name}"
            _, in_gpu = _train(copy.deepcopy(config))
            engine, got = _train(config, model=model)
            _assert_parameters_on_cpu(engine, f"zero.Init {what}")
            _moved_bound(got, _flat(in_gpu), init, STEPS, f"zero.Init {what}")
        except AssertionError as err:
            failures.append(str(err))
        engine = model = None
    # ... and in bf16 (zero.Init(dtype=...)): the same as training a model rounded to bf16 first.
    try:
        config = _config(3, "bf16", offload_param=_on_cpu(), offload_optimizer=_on_cpu())
        with zeroshard.zero.Init(
            remote_device="cpu", config_dict_or_path=copy.deepcopy(config), dtype=torch.bfloat16
        ):
            model = _model()
        for name, p in model.named_parameters():
            where = (p.ds_tensor.dtype, p.ds_tensor.device.type)
            assert where == (torch.bfloat16, "cpu"), f"zero.Init bf16: {name} partition is {where}"
        rounded = _model().to(torch.bfloat16).float()
        init_rounded = {n: p.detach().float().reshape(-1) for n, p in rounded.named_parameters()}
        _, in_gpu = _train(copy.deepcopy(config), model=rounded)
        engine, got = _train(config, model=model)
        _moved_bound(got, _flat(in_gpu), init_rounded, STEPS, "zero.Init bf16")
    except AssertionError as err:
        failures.append(str(err))
    engine = model = rounded = None

    # GPU memory, on a model large enough to tell, built by zero.Init: initialize never has it whole on the
    # GPU (beyond the model state the config keeps there: the masters without offload_optimizer), and between
    # steps no GPU memory holds a 16-bit parameter shard.
    for what, base in cases[:2]:
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        config = _config(3, "bf16", offload_param=_on_cpu(), **copy.deepcopy(base))
        with zeroshard.zero.Init(remote_device="cpu", config_dict_or_path=copy.deepcopy(config)):
            model = _wide_model()
        full_bytes = sum(p.ds_numel for p in model.parameters()) * torch.bfloat16.itemsize
        torch.cuda.reset_peak_memory_stats()
        engine, _ = _train(config, steps=0, model=model)
        init_excess = torch.cuda.max_memory_allocated() - before - _gpu_state_bytes(engine)
        for step in range(STEPS):
            engine.backward(engine(*_batch(step, 0)))
            engine.step()
        residue, shards = _parameter_residue(engine, before)
        report[f"wide model, {what}: initialize's GPU peak besides the model state, MiB"] = (
            init_excess / 2**20
        )
        report[f"wide model, {what}: GPU MiB besides the model state between steps"] = residue / 2**20
        report[f"wide model, {what}: 16-bit shards MiB"] = shards / 2**20
        try:
            assert init_excess < full_bytes / 2, (
                f"{what}: initialize held {init_excess} of {full_bytes} bytes"
            )
            _assert_parameters_on_cpu(engine, f"wide model, {what}")
            assert residue < shards / 10, (
                f"{what}: {residue} GPU bytes besides the model state; shards {shards}"
            )
        except AssertionError as err:
            failures.append(str(err))
        engine = model = None
    return report, failures


def test_parameters_offloaded_to_pinned_cpu_memory() -> None:
    ((report, failures),) = run_distributed(offload_param_worker, 1, backend="nccl", timeout=300)
    for key, value in report.items():
        print(f"{key}: {value:.3g}")
    assert not failures, "\n".join(failures)


def cuda_worker(rank: int, world_size: int, nvme_dir: str) -> dict[str, Any]:
    report = _Report()
    init = {n: p.detach().float().reshape(-1) for n, p in _model().named_parameters()}

    # Where things live: the engine moves the model to cuda:LOCAL_RANK, as DeepSpeed does.
    engine, _ = _train(_config(2), steps=1)
    assert engine.device == torch.device("cuda", 0), engine.device
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    assert engine.comm.device.type == "cuda"

    # fp32 parity, every stage, with accumulation and clipping.
    ref = _reference("fp32")
    for stage in (0, 1, 2, 3):
        _, got = _train(_config(stage))
        report[f"fp32 stage {stage}"] = _close(got, ref, 1e-6, 1e-7, f"fp32 stage {stage}")
    ref_acc = _reference("fp32", gas=2, clip=0.05)
    for stage in (0, 2, 3):
        _, got = _train(_config(stage, gas=2, clip=0.05))
        report[f"fp32 stage {stage} gas 2 clip"] = _close(got, ref_acc, 1e-5, 1e-6, f"fp32 {stage} acc")

    # 16-bit kernels on the GPU against the same recipe by hand.
    for precision in ("bf16", "fp16"):
        want = _reference(precision)
        for stage in (0, 1, 2, 3):
            engine, got = _train(_config(stage, precision))
            assert all(
                p.dtype == getattr(torch, {"bf16": "bfloat16"}.get(precision, "float16"))
                for p in engine.module.parameters()
            )
            _moved_bound(got, want, init, STEPS, f"{precision} stage {stage}")

    # ZeRO-Offload: masters and optimizer state in pinned CPU memory, the step on the CPU.
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            _, in_gpu = _train(_config(stage, precision))
            engine, got = _train(_config(stage, precision, offload_optimizer={"device": "cpu"}))
            for unit in engine.units:
                assert unit.master.device.type == "cpu" and unit.master.is_pinned(), unit.names
            for state in engine.optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.numel() > 1:
                        assert value.device.type == "cpu", "optimizer state left on the GPU"
            what = f"cpu offload {precision} stage {stage}"
            if precision == "fp32":
                report[what] = _close(got, _flat(in_gpu), 1e-5, 1e-6, what)
            else:  # an ulp of the master can flip a bf16 rounding: the mixed-precision tolerance
                _moved_bound(got, _flat(in_gpu), init, STEPS, what)

    # ZeRO-Infinity on a GPU: optimizer state and stage-3 parameter shards in NVMe files.
    for stage in (2, 3):
        nvme = {"device": "nvme", "nvme_path": nvme_dir}
        extra: dict[str, Any] = {"offload_optimizer": nvme, "sub_group_size": 3000}
        if stage == 3:
            extra["offload_param"] = nvme
        _, in_gpu = _train(_config(stage, "bf16"))
        engine, got = _train(_config(stage, "bf16", **extra))
        _moved_bound(got, _flat(in_gpu), init, STEPS, f"nvme offload bf16 stage {stage}")
        engine.destroy()

    # zero.Init on the GPU machine: partitioned on the CPU, moved and gathered on the GPU; same result.
    with zeroshard.zero.Init():
        model = _model()
    _, got = _train(_config(3), model=model)
    report["zero.Init stage 3"] = _close(got, ref, 1e-6, 1e-7, "zero.Init stage 3")

    # A checkpoint saved on the GPU resumes at another stage and precision.
    engine, _ = _train(_config(2, "bf16"), steps=2)
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_checkpoint(tmp)
        before = _masters(engine)
        other = _model()
        resumed, _, _, _ = zeroshard.initialize(
            model=other, optimizer=torch.optim.AdamW(other.parameters(), lr=LR), config=_config(3, "bf16")
        )
        path, _ = resumed.load_checkpoint(tmp)
        assert path is not None
        after = _masters(resumed)
        for name, value in after.items():
            assert torch.equal(value.reshape(-1), before[name].reshape(-1)[: value.numel()]), name
        resumed.backward(resumed(*_batch(9, 0)))
        resumed.step()
    report["peak GPU MiB"] = torch.cuda.max_memory_allocated() / 2**20
    return report


def test_cuda_paths_on_one_gpu_with_nccl() -> None:
    with tempfile.TemporaryDirectory() as nvme_dir:
        (report,) = run_distributed(cuda_worker, 1, nvme_dir, backend="nccl", timeout=600)
    for key, value in report.items():
        print(f"{key}: {value:.3g}")


def offload_states_worker(rank: int, world_size: int) -> dict[str, float]:
    """``engine.offload_states()`` frees the model state's GPU memory (pinned CPU copies hold it), and after
    ``reload_states()`` training goes on bit-identical to a run that never offloaded."""
    import os

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first matmul: deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    report = _Report()
    for stage, precision, gas in ((1, "fp32", 1), (2, "bf16", 2), (3, "fp32", 2), (3, "bf16", 1)):
        what = f"offload_states stage {stage} {precision} gas {gas}"
        config = _config(stage, precision, gas=gas, clip=1.0)
        _, want = _train(config)
        engine, _ = _train(config, steps=1)
        held = _gpu_state_bytes(engine)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine.offload_states()
        freed = before - torch.cuda.memory_allocated()
        assert held > 0 and freed >= held, f"{what}: freed {freed} of {held} bytes of model state"
        assert all(u.master.device.type == "cpu" and u.master.is_pinned() for u in engine.units), what
        engine.reload_states()
        assert all(u.master.is_cuda for u in engine.units), what
        assert all(p.is_cuda for p in engine.module.parameters()), what
        for step in range(1, STEPS):
            for micro in range(gas):
                engine.backward(engine(*_batch(step, micro)))
                engine.step()
        got = _masters(engine)
        for name, value in got.items():
            err = float((value - want[name]).abs().max())
            assert torch.equal(value, want[name]), f"{what}: {name} differs by {err:.3g} after reload_states"
        report[f"{what}: freed MiB"] = freed / 2**20
    return report


def test_offload_states_frees_gpu_memory_and_trains_the_same() -> None:
    (report,) = run_distributed(offload_states_worker, 1, backend="nccl", timeout=300)
    for key, value in report.items():
        print(f"{key}: {value:.3g}")
