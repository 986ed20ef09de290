"""zeroshard against its peers on one GPT, one machine, one session (issue 7).

    .venv/bin/python bench/peers.py                 # both sizes (make bench); prints its estimate, ETA, total
    .venv/bin/python bench/peers.py --size small    # only the ~10M speed model (the other size is kept)
    .venv/bin/python bench/peers.py --large-offload # also the offload rows at the large size (~5 min more)
    .venv/bin/python bench/peers.py --quick         # tiny, 3 steps, torch peers + zeroshard (smoke test)

Systems, at W=2 (``ZEROSHARD_BENCH_WORLD_SIZE=4`` for four ranks) on gloo/CPU, fp32 AdamW (lr 1e-3, wd 0.01),
gradient clipping 1.0: PyTorch DDP, torch ``ZeroRedundancyOptimizer`` (stage-1 peer), FSDP2 ``fully_shard``
with ``reshard_after_forward=False`` (stage-2 peer) and with resharding (stage-3 peer), zeroshard stages 0-3
(stage 3 also ``-lean``, see ``lean_stage3``) and its NVMe offload (stage 2 with the optimizer on NVMe, stage
3 with optimizer and parameters on NVMe), DeepSpeed stages 0-3 and its optimizer offload to CPU (stages 2 and
3, ``DeepSpeedCPUAdam``) and to NVMe (stage 3), and stage 3 ``-lean``, run by the interpreter of
``bench/.venv-peers`` (or ``--deepspeed-python``) with ``DS_ACCELERATOR=cpu`` when it exists. The offload rows
run at the small size only unless ``--large-offload``. Before the runs, that interpreter loads (building on
first use, timed) the DeepSpeed ops the offload rows need; a row whose op cannot load here is reported as "did
not run" with the reason, and so is a run that fails (the command then exits non-zero after writing
everything). NVMe files go to a temporary directory under ``$ZEROSHARD_BENCH_NVME`` (default: the system's
temp dir).

Every (round, system) is a fresh pair of interpreters, one per rank; systems are interleaved (A B C A B C
...) and every figure is also given as a ratio to DDP of the same round. Raw results:
``bench/results/peers.json`` (``peers_quick.json`` for --quick); ``docs/benchmarks.md``'s peers section and
``docs/bench_*.png`` are regenerated from it by ``bench/report.py`` (not for --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import (
    CLIP,
    LR,
    ROOT,
    WEIGHT_DECAY,
    WORLD_SIZE,
    build_gpt,
    ds_config,
    peak_rss,
    rank_main,
    reachable_tensor_bytes,
    rss,
    run_pair,
    run_ranks,
    tokens_for,
)

# isort: split
import report
import torch
import torch.distributed as dist

PEERS_PY = ROOT / "bench" / ".venv-peers" / "bin" / "python"
RESULTS = ROOT / "bench" / "results"

SIZES: dict[str, dict[str, Any]] = {
    # Speed: PEERS.md's small model, 4 x 128 tokens per rank per step. One warm-up step allocates the
    # optimizer state and (zeroshard stage 3) records the gather order; the median of 10 steps follows.
    "small": {
        "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
        "micro_batch": 4,
        "seq_len": 128,
        "warmup": 1,
        "steps": 10,
        "rounds": 2,
        "offload_rows": True,
    },
    # Memory: PEERS.md's large model fed 1 x 32 tokens per rank per step, so that a step is the model-state
    # work the stages differ in (gradient reduction, optimizer step, gathers), not activations' compute (at
    # 2 x 128 tokens this size alone took about 28 minutes). Offload rows only with --large-offload: they
    # add about 5 minutes, which the 30 do not leave.
    "large": {
        "model": {"vocab_size": 16384, "block_size": 128, "n_layer": 12, "n_head": 16, "n_embd": 1024},
        "micro_batch": 1,
        "seq_len": 32,
        "warmup": 1,
        "steps": 10,
        "rounds": 1,
        "offload_rows": False,
    },
    "quick": {
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "seq_len": 32,
        "warmup": 1,
        "steps": 3,
        "rounds": 1,
        "offload_rows": True,
    },
}


@dataclass(frozen=True)
class System:
    """One row of the tables: which code runs it, at which ZeRO stage it is compared, what it offloads."""

    stage: int
    """The ZeRO stage the system is compared at (torch's peers: the stage they shard like)."""
    runner: str
    """``torch``, ``zeroshard`` or ``deepspeed``: the code that trains, and so the venv that runs it."""
    offload: str = ""
    """What it offloads: ``""`` nothing, ``cpu-opt`` the optimizer to CPU memory, ``nvme-opt`` the optimizer
    to NVMe, ``nvme-opt-param`` the optimizer and the parameter shards to NVMe."""
    comm_4n: float = 0.0
    """Peers only: bytes one rank moves per step, in units of 4N, by formula (zeroshard's are measured)."""
    lean: bool = False
    """Stage 3 with the memory-lean settings of ``LEAN_STAGE3`` instead of DeepSpeed's defaults."""

    @property
    def family(self) -> str:
        """What the plots group by: the runner, plus where it offloads."""
        return self.runner + {"": "", "cpu-opt": " CPU offload"}.get(self.offload, " NVMe offload")

    def in_memory_bytes_per_param(self) -> float:
        """ZeRO's model-state bytes per parameter this rank keeps in memory (fp32 Adam: 4 params + 4 grads +
        8 Adam), less what NVMe offload moves to files; CPU offload on a CPU-only machine moves nothing."""
        w = WORLD_SIZE
        params = 4 / w if self.stage == 3 else 4.0
        grads = 4 / w if self.stage >= 2 else 4.0
        optim = 8 / w if self.stage >= 1 else 8.0
        if self.offload.startswith("nvme"):
            optim = 0.0
        if self.offload == "nvme-opt-param":
            params = 0.0
        return params + grads + optim

    def describe(self) -> dict[str, Any]:
        """What ``report.summarise`` needs to know of the system, kept in the JSON beside its results."""
        return {
            "stage": self.stage,
            "runner": self.runner,
            "offload": self.offload,
            "family": self.family,
            "comm_4n": self.comm_4n,
            "lean": self.lean,
            "in_memory_bytes_per_param": self.in_memory_bytes_per_param(),
        }


# Comm formula, counted as zeroshard's ``comm.stats`` counts: a ring all-reduce 2 x its buffer, an all-gather,
# reduce-scatter or broadcast 1 x the full buffer.
SYSTEMS: dict[str, System] = {
    "ddp": System(0, "torch", comm_4n=2),  # all-reduce gradients
    "torch-zero1": System(1, "torch", comm_4n=3),  # all-reduce gradients, broadcast updated shards
    "fsdp2-noreshard": System(2, "torch", comm_4n=2),  # all-gather once, reduce-scatter gradients
    "fsdp2": System(3, "torch", comm_4n=3),  # all-gather forward and backward, reduce-scatter
    **{f"zeroshard-stage{s}": System(s, "zeroshard") for s in range(4)},
    "zeroshard-stage2-nvme-opt": System(2, "zeroshard", "nvme-opt"),
    "zeroshard-stage3-nvme-opt-param": System(3, "zeroshard", "nvme-opt-param"),
    # stages 0-2: all-reduce, or reduce-scatter + all-gather; stage 3 gathers in backward again
    "zeroshard-stage3-lean": System(3, "zeroshard", lean=True),
    **{f"deepspeed-stage{s}": System(s, "deepspeed", comm_4n=2 if s < 3 else 3) for s in range(4)},
    "deepspeed-stage3-lean": System(3, "deepspeed", comm_4n=3, lean=True),
    "deepspeed-stage2-cpu-opt": System(2, "deepspeed", "cpu-opt", 2),
    "deepspeed-stage3-cpu-opt": System(3, "deepspeed", "cpu-opt", 3),
    "deepspeed-stage3-nvme-opt": System(3, "deepspeed", "nvme-opt", 3),
}

# The DeepSpeed ops (``deepspeed.ops.op_builder`` names) each offload mode needs: DeepSpeed steps offloaded
# optimizer state with its C++ CPU Adam, and moves it to and from NVMe with its async I/O op (libaio).
DS_OPS_NEEDED = {"cpu-opt": ["cpu_adam"], "nvme-opt": ["cpu_adam", "async_io"]}

# Seconds one run takes (two interpreters started, model built, 1 + 10 steps, exit), for the up-front estimate
# and the ETA only. Measured on 2026-11-22 with nothing else running: small, one round of every system; large,
# DDP 40 s, zeroshard stage 3 61 s, DeepSpeed stage 3 80 s, the other systems' runs at load 5 times 0.5.
EXPECTED_RUN_S = {  # runner: (in memory, offload)
    "small": {"torch": (14, 14), "zeroshard": (12, 15), "deepspeed": (15, 19)},
    "large": {"torch": (50, 50), "zeroshard": (48, 80), "deepspeed": (60, 58)},
    "quick": {"torch": (1, 1), "zeroshard": (1, 1), "deepspeed": (15, 15)},
}


# ----------------------------------------------------------------------------------------------- workers


def _torch_system(system: str, model: torch.nn.Module) -> tuple[Any, Any, list[Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if system in ("ddp", "torch-zero1"):
        ddp = DDP(model, gradient_as_bucket_view=True)
        if system == "ddp":
            opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY
            )
        return ddp, opt, [list(model.parameters()), opt]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    reshard = system == "fsdp2"
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, opt, [list(model.parameters()), opt]


def _library(rank: int, system: System) -> Any:
    """zeroshard or DeepSpeed, imported (before the RSS baseline: the library's own footprint is not model
    state), or None for the torch peers."""
    if system.runner == "deepspeed":
        # DeepSpeed reads these even when the process group is already up (it asserts on LOCAL_RANK).
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        import deepspeed

        return deepspeed
    if system.runner == "zeroshard":
        import zeroshard

        return zeroshard
    return None


def _engine(library: Any, system: System, model: torch.nn.Module, spec: dict[str, Any]) -> Any:
    """``library.initialize`` on the run's ds_config (the same for zeroshard and DeepSpeed but one key)."""
    cfg = ds_config(spec["zero"], spec["micro_batch"])
    extra = {}
    if system.runner == "deepspeed":
        extra["dist_init_required"] = False
        # With offload DeepSpeed steps with its DeepSpeedCPUAdam (loaded beforehand by ``probe_deepspeed``).
        if not system.offload:
            cfg["optimizer"]["params"]["torch_adam"] = True  # no fused Adam op on CPU (DS_BUILD_OPS=0)
    engine, _, _, _ = library.initialize(
        model=model, model_parameters=model.parameters(), config=cfg, **extra
    )
    return engine


def worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One system on one rank: build, warm up, time ``steps`` steps. Collective: both ranks run it."""
    t_start = time.perf_counter()
    name = spec["system"]
    system = SYSTEMS[name]
    library = _library(rank, system)
    baseline = rss()
    model = build_gpt(spec["model"])
    n_params = sum(p.numel() for p in model.parameters())
    engine: Any = None
    if library is not None:
        engine = _engine(library, system, model, spec)
    else:
        fwd, opt, roots = _torch_system(name, model)
    n_steps = spec["warmup"] + spec["steps"]
    tokens = tokens_for(rank, n_steps, spec["micro_batch"], spec["model"], spec["seq_len"])

    state = 0

    def step(i: int) -> float:
        nonlocal state
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        if engine is not None:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        else:
            loss = fwd(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            if i == n_steps - 1:  # gradients are still allocated: count them with the rest of the state
                state = reachable_tensor_bytes(roots)
            opt.zero_grad()
        return float(loss.item())

    init_s = time.perf_counter() - t_start
    losses = [step(i) for i in range(spec["warmup"])]
    dist.barrier()
    bytes0 = engine.comm.stats.total_bytes if system.runner == "zeroshard" else 0
    times: list[float] = []
    for i in range(spec["warmup"], n_steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    offloaded = cached = buckets = dropped = None
    if system.runner == "zeroshard":
        breakdown = engine.memory_breakdown()
        state, offloaded, cached = breakdown.total, breakdown.offloaded, breakdown.cached_buffers
        buckets = breakdown.communication_buffers  # the peak of the transient gradient buckets
        # Gradient shards the step's zero_grad dropped (stages 2-3: [Note: gradient shards on demand]).
        dropped = sum(
            u.layout.shard_size * u.policy.accumulate.itemsize for u in engine.units if not u.holds_grad_shard
        )
        comm = (engine.comm.stats.total_bytes - bytes0) / spec["steps"]
    else:
        if system.runner == "deepspeed":
            state = reachable_tensor_bytes([list(model.parameters()), engine.optimizer])
        comm = None
    peak = peak_rss() - baseline
    after = rss() - baseline  # between steps: model state, idle pooled buffers, the framework's own
    if system.runner == "zeroshard":
        engine.destroy()  # closes and removes its NVMe files (--quick runs every system in one process)
    return {
        "times": times,
        "losses": losses,
        "num_parameters": n_params,
        "model_state_bytes": state,
        "offloaded_bytes": offloaded,
        "comm_bytes_per_step_measured": comm,
        "rss_baseline_bytes": baseline,
        "peak_rss_above_baseline_bytes": peak,
        "rss_after_steps_above_baseline_bytes": after,
        "cached_buffer_bytes": cached,
        "communication_buffer_bytes": buckets,
        "dropped_gradient_bytes": dropped,
        "init_s": init_s,
        "run_s": time.perf_counter() - t_start,
    }


def lean_stage3(model: dict[str, Any]) -> dict[str, Any]:
    """The ``-lean`` rows' stage-3 settings: release every unit after its forward
    (``stage3_max_reuse_distance`` 0: DeepSpeed's default, 1e9, keeps every unit of a model under 1e9
    parameters gathered from its forward to its backward) and prefetch one unit ahead (the Hugging Face
    integration's ``auto``, 0.9 x width**2), as FSDP2 with resharding reshards after forward and prefetches
    one module."""
    return {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": int(0.9 * model["n_embd"] ** 2)}


def zero_block(name: str, size: dict[str, Any], nvme_dir: str) -> dict[str, Any]:
    """The ``zero_optimization`` block both zeroshard and DeepSpeed get for ``name``: DeepSpeed's defaults
    but for the stage and, for offload rows, the offload blocks and a ``sub_group_size`` of four
    width-by-width matrices, so that both step (and swap) the optimizer state in pieces, not in one."""
    system = SYSTEMS[name]
    zero: dict[str, Any] = {"stage": system.stage}
    if system.lean:
        zero.update(lean_stage3(size["model"]))
    if system.offload:
        zero["sub_group_size"] = 4 * size["model"]["n_embd"] ** 2
        device = "cpu" if system.offload == "cpu-opt" else "nvme"
        where = {"device": device, **({"nvme_path": nvme_dir} if device == "nvme" else {})}
        zero["offload_optimizer"] = where
        if system.offload == "nvme-opt-param":
            zero["offload_param"] = where
    return zero


def probe_deepspeed(out_file: str) -> None:
    """``--probe-ds`` (run by bench/.venv-peers' interpreter): load, building on first use, each DeepSpeed
    op of ``DS_OPS_NEEDED``; write per op whether it loaded, whether it had to be built, the seconds it took,
    and otherwise why not (the builder's own compatibility messages and the error)."""
    import contextlib
    import io
    import re

    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    from torch.utils.cpp_extension import _get_build_directory

    result: dict[str, Any] = {"deepspeed": deepspeed.__version__}
    for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
        t0 = time.perf_counter()
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            compatible = builder.is_compatible(verbose=True)
        entry: dict[str, Any] = {"ok": False, "compatible": compatible, "built": False}
        if not compatible:
            # DeepSpeed's load() makes the same check and raises, but only after building the ops it loads
            # first (async_io: pin_memory, about 3 minutes here), for nothing.
            lines = [
                re.sub(r"\x1b\[[0-9;]*m|\[WARNING\]", "", m).strip() for m in said.getvalue().splitlines()
            ]
            entry["reason"] = "; ".join(m.rstrip(".") for m in lines if m)[:600] or "not compatible here"
        else:
            so = Path(_get_build_directory(builder.name, verbose=False), f"{builder.name}.so")
            cached = so.exists()
            try:
                builder.load(verbose=False)
                entry.update(ok=True, built=not cached)
            except Exception as e:
                entry["reason"] = f"{type(e).__name__}: {e}"[:600]
        entry["seconds"] = time.perf_counter() - t0
        result[builder.name] = entry
    Path(out_file).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ parent


def reference_losses(size: dict[str, Any]) -> list[float]:
    """Single-process training on both ranks' tokens concatenated: the losses every system should match."""
    torch.set_num_threads(1)
    model = build_gpt(size["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    n = size["warmup"] + size["steps"]
    toks = torch.cat(
        [tokens_for(r, n, size["micro_batch"], size["model"], size["seq_len"]) for r in range(WORLD_SIZE)],
        dim=1,
    )
    out = []
    for i in range(n):
        loss = model(toks[i, :, :-1], toks[i, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append(float(loss.item()))
    return out


def run_system(name: str, size: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """One fresh pair of interpreters (the right venv's) for system ``name``; per-rank results."""
    deepspeed = SYSTEMS[name].runner == "deepspeed"
    with tempfile.TemporaryDirectory(
        prefix="peers-nvme-", dir=os.environ.get("ZEROSHARD_BENCH_NVME")
    ) as nvme:
        spec = {"name": name, "runs": [{**size, "system": name, "zero": zero_block(name, size, nvme)}]}
        per_rank = run_ranks(
            str(PEERS_PY) if deepspeed else sys.executable,
            __file__,
            spec,
            timeout=timeout,
            env=dict(os.environ, DS_ACCELERATOR="cpu"),
        )
    return [r[0] for r in per_rank]


def deepspeed_ops() -> dict[str, Any]:
    """Run ``probe_deepspeed`` under bench/.venv-peers and print what it found (a first build: minutes)."""
    import subprocess

    print(
        "DeepSpeed ops for the offload rows: loading cpu_adam and async_io (built on first use) ...",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "ops.json")
        proc = subprocess.run(
            [str(PEERS_PY), __file__, "--probe-ds", str(out)],
            env=dict(os.environ, DS_ACCELERATOR="cpu"),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0:
            reason = f"the DeepSpeed op probe failed: {proc.stderr.strip().splitlines()[-1:]}"
            return {op: {"ok": False, "reason": reason} for op in ("cpu_adam", "async_io")}
        ops = json.loads(out.read_text())
    for op in ("cpu_adam", "async_io"):
        o = ops[op]
        how = "built (first use)" if o["built"] else "loaded from the torch extensions cache"
        print(
            f"  {op}: {how if o['ok'] else 'cannot load: ' + o['reason']} ({o['seconds']:.1f} s)", flush=True
        )
    return ops


def did_not_run(name: str, ops: dict[str, Any] | None) -> str | None:
    """Why ``name`` cannot run here, known before it is tried (a DeepSpeed op that does not load), or None."""
    system = SYSTEMS[name]
    if system.runner != "deepspeed" or ops is None:
        return None
    for op in DS_OPS_NEEDED.get(system.offload, []):
        if not ops[op]["ok"]:
            return f"DeepSpeed's {op} op does not load here: {ops[op]['reason']}"
    return None


def expected_s(size_name: str, system: str) -> float:
    """``EXPECTED_RUN_S`` of one run of ``system`` at ``size_name``."""
    s = SYSTEMS[system]
    return EXPECTED_RUN_S[size_name][s.runner][bool(s.offload)]


def systems_at(size: dict[str, Any], systems: list[str]) -> list[str]:
    """The systems of ``systems`` that run at ``size`` (offload rows only where the size asks for them)."""
    return [s for s in systems if size["offload_rows"] or not SYSTEMS[s].offload]


class Clock:
    """Elapsed time of the whole command and, from how much slower than ``EXPECTED_RUN_S`` the runs so far
    went, an estimate of the time left."""

    def __init__(self, plan: dict[str, tuple[dict[str, Any], list[str]]]) -> None:
        self.start = time.time()
        self.left = sum(sz["rounds"] * sum(expected_s(n, s) for s in ss) for n, (sz, ss) in plan.items())
        self.expected_done = 0.0
        self.runs_s = 0.0

    def done(self, size_name: str, system: str, seconds: float) -> str:
        e = expected_s(size_name, system)
        self.left -= e
        self.expected_done += e
        self.runs_s += seconds
        eta = self.left * self.runs_s / self.expected_done
        return f"[{(time.time() - self.start) / 60:.1f} min, about {eta / 60:.0f} min left]"


def run_size(
    size_name: str,
    size: dict[str, Any],
    systems: list[str],
    ops: dict[str, Any] | None,
    clock: Clock | None,
) -> dict[str, Any]:
    """Every system of ``systems`` at one size, interleaved over rounds; the size's entry of the JSON."""
    t0 = time.time()
    load_before = os.getloadavg()
    ref = reference_losses(size)
    not_run = {s: why for s in systems if (why := did_not_run(s, ops)) is not None}
    failed: dict[str, str] = {}
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    todo = [s for s in systems if s not in not_run]
    # --quick: one process pair runs every torch and zeroshard system in turn (spawning costs seconds per
    # pair), so its peak RSS figures are cumulative and mean nothing; it checks that every system runs and
    # agrees in loss. DeepSpeed needs its own interpreter: one pair per system.
    quick = clock is None
    if quick:
        local = [s for s in todo if SYSTEMS[s].runner != "deepspeed"]
        with tempfile.TemporaryDirectory(prefix="peers-nvme-") as nvme:
            runs = [{**size, "system": s, "zero": zero_block(s, size, nvme)} for s in local]
            per_rank = run_pair(worker, {"name": "quick", "runs": runs})
        rnd0 = {s: [per_rank[k][i] for k in range(WORLD_SIZE)] for i, s in enumerate(local)}
        rnd0.update({s: run_system(s, size, timeout=600) for s in todo if s not in rnd0})
        rounds.append(rnd0)
    timeout = 300 if size_name == "small" else 900
    for r in range(0 if quick else size["rounds"]):
        rnd: dict[str, list[dict[str, Any]]] = {}
        for name in [s for s in todo if s not in failed]:
            t1 = time.time()
            try:
                rnd[name] = run_system(name, size, timeout=timeout)
            except RuntimeError as e:
                if name == "ddp":
                    raise  # every ratio is to DDP
                failed[name] = str(e).splitlines()[0] + " (see the console for its output)"
                print(f"{size_name} round {r + 1}: {name} FAILED:\n{e}", flush=True)
                continue
            res, wall = rnd[name], time.time() - t1
            med = statistics.median(max(ts) for ts in zip(*(x["times"] for x in res), strict=True))
            print(
                f"{size_name} round {r + 1}/{size['rounds']} {name:>31}: median {med:.3f} s/step, "
                f"{wall:.0f} s wall (start-up {max(x['init_s'] for x in res):.0f} s) "
                f"{clock.done(size_name, name, wall) if clock else ''}",
                flush=True,
            )
        rounds.append(rnd)
    for name in failed:  # a system that failed in a later round has no figures to pool
        for rnd in rounds:
            rnd.pop(name, None)
    entry = {
        "settings": {**size, "world_size": WORLD_SIZE, "backend": "gloo"},
        "num_parameters": rounds[0]["ddp"][0]["num_parameters"],
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
        "wall_s": time.time() - t0,
        "reference_losses": ref,
        "did_not_run": {**not_run, **failed},
        "failed": sorted(failed),
        "systems": {s: SYSTEMS[s].describe() for s in systems},
        "raw": rounds,
    }
    entry["summary"] = report.summarise(entry)
    return entry


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, torch peers + zeroshard")
    parser.add_argument("--size", choices=["small", "large", "both"], default="both")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (defaults: small 2, large 1)")
    parser.add_argument(
        "--steps", type=int, help="timed steps per run (default 10; fewer only to try things)"
    )
    parser.add_argument("--warmup", type=int, help="warm-up steps per run (default 1)")
    parser.add_argument(
        "--large-offload",
        action="store_true",
        help="run the offload rows at the large size too (~5 min more)",
    )
    parser.add_argument("--only", nargs="+", help="run only these systems (ddp is always included)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    parser.add_argument(
        "--deepspeed-python",
        type=Path,
        help=f"interpreter with DeepSpeed and the same torch for the DeepSpeed rows (default {PEERS_PY})",
    )
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/peers[_quick].json)")
    parser.add_argument("--no-docs", action="store_true", help="do not regenerate docs/benchmarks.md")
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="recompute summaries and docs from the raw results in --out",
    )
    parser.add_argument("--rank", nargs=3, metavar=("RANK", "SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--probe-ds", metavar="OUT", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    global PEERS_PY
    started = time.time()
    args = parse_args()
    if args.deepspeed_python:
        PEERS_PY = args.deepspeed_python
    if args.rank:  # one rank of a run (``common.run_ranks``)
        rank_main(worker, int(args.rank[0]), args.rank[1], args.rank[2])
        return
    if args.probe_ds:
        probe_deepspeed(args.probe_ds)
        return
    if args.resummarise:
        path = args.out or RESULTS / "peers.json"
        doc = json.loads(path.read_text())
        for size in doc["sizes"].values():
            size.setdefault("did_not_run", {})
            ran = set(size["raw"][0]) | set(size["did_not_run"])
            size["systems"] = {s: SYSTEMS[s].describe() for s in SYSTEMS if s in ran}
            size["summary"] = report.summarise(size)
        path.write_text(json.dumps(doc, indent=1))
        report.write_docs(doc)
        return
    sizes = ["quick"] if args.quick else (["small", "large"] if args.size == "both" else [args.size])
    use_ds = not args.no_deepspeed and PEERS_PY.exists() and (not args.quick or bool(args.only))
    systems = [s for s, sy in SYSTEMS.items() if sy.runner != "deepspeed" or use_ds]
    if args.only:
        unknown = sorted(set(args.only) - set(SYSTEMS))
        if unknown:
            raise SystemExit(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
        systems = [s for s in systems if s == "ddp" or s in args.only]
    plan: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for name in sizes:
        size = {
            **SIZES[name],
            "rounds": args.rounds or SIZES[name]["rounds"],
            "steps": args.steps or SIZES[name]["steps"],
            "warmup": args.warmup if args.warmup is not None else SIZES[name]["warmup"],
        }
        if name == "large" and args.large_offload:
            size["offload_rows"] = True
        plan[name] = (size, systems_at(size, systems))
    clock = None if args.quick else Clock(plan)
    print(
        "; ".join(f"{n}: {len(ss)} systems x {sz['rounds']} round(s)" for n, (sz, ss) in plan.items())
        + (f"; expect about {clock.left / 60:.0f} min (EXPECTED_RUN_S in bench/peers.py)" if clock else ""),
        flush=True,
    )
    ops = None
    if use_ds and any(SYSTEMS[s].offload in DS_OPS_NEEDED for _, ss in plan.values() for s in ss):
        ops = deepspeed_ops()
    out_path = args.out or RESULTS / ("peers_quick.json" if args.quick else "peers.json")
    doc: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() and not args.quick else {}
    doc.setdefault("sizes", {})
    if ops is not None:
        doc["deepspeed_ops"] = ops
    for size_name, (size, size_systems) in plan.items():
        doc["sizes"][size_name] = run_size(size_name, size, size_systems, ops, clock)
        print("\n" + report.table(doc["sizes"][size_name]), flush=True)
    doc["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "deepspeed_python": str(PEERS_PY) if use_ds else None,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_path}")
    bad = [
        (s, k)
        for size in doc["sizes"].values()
        for s, row in size["summary"].items()
        for k, v in row.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]
    if not args.quick and not args.no_docs:
        report.write_docs(doc)
    failed = {n: doc["sizes"][n]["failed"] for n in sizes if doc["sizes"][n]["failed"]}
    print(f"bench/peers.py: {(time.time() - started) / 60:.1f} min in all", flush=True)
    if bad:
        raise SystemExit(f"non-finite figures: {bad}")
    if failed:
        raise SystemExit(f"systems that failed (their rows say 'did not run'): {failed}")


if __name__ == "__main__":
    main()
