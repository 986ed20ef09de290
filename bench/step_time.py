"""Step time of zeroshard stages 0-3 against DDP (and DeepSpeed) on a tiny MLP and the small GPT (#3, #18).

    .venv/bin/python bench/step_time.py                    # both models, DDP + zeroshard, 3 rounds (~6 min)
    .venv/bin/python bench/step_time.py --deepspeed-python bench/.venv-peers/bin/python   # DeepSpeed rows too
    .venv/bin/python bench/step_time.py --models mlp      # only the tiny MLP
    .venv/bin/python bench/step_time.py --stage3-variants # also stage 3 at block granularity
    .venv/bin/python bench/step_time.py --profile zeroshard-stage2  # also cProfile rank 0 of that system
    .venv/bin/python bench/step_time.py --quick           # tiny sizes, 3 steps, one round: a smoke test

Models (fp32 AdamW lr 1e-3, weight decay 0.01, ``gradient_clipping`` 1.0, W=2, gloo on CPU):

* ``mlp``: a 235k-parameter MLP (256-384-256-128-32, GELU), 32 samples per rank per step, MSE loss: a step
  is almost all fixed cost (hooks, Python, collectives' latency), the cost every small experiment pays.
* ``gpt``: PEERS.md's small model, the demo GPT of ``examples/train_gpt.py`` (4 layers, width 384, vocab
  8192, 10.3M parameters with the tied head), 4 x 128 tokens per rank per step.

Systems: PyTorch DDP (``gradient_as_bucket_view=True``, ``clip_grad_norm_``), zeroshard stages 0-3 (stage 3
with ``stage3_param_persistence_threshold`` 1e4, ``stage3_max_reuse_distance`` 0 and a prefetch of two
blocks), and with ``--deepspeed-python`` DeepSpeed stages 0-3 (its defaults but the stage, ``torch_adam``,
``DS_ACCELERATOR=cpu``), run by that interpreter. Every (round, system) is a fresh pair of interpreters, one
per rank, which runs the MLP and then the GPT; systems are interleaved (A B C A B C ...) and each system's
time is also given as the median over rounds of the in-round ratio to DDP's. A step's time is the slower
rank's. Raw results: ``bench/results/step_time.json`` (``step_time_quick.json`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import itertools
import json
import os
import platform
import pstats
import statistics
import sys
import time
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
    run_ranks,
    tokens_for,
)

# isort: split
import psutil
import torch
import torch.distributed as dist
from torch import nn

RESULTS = ROOT / "bench" / "results"

MODELS: dict[str, dict[str, Any]] = {
    # Fixed cost per step: 235k parameters, 32 samples per rank.
    "mlp": {"kind": "mlp", "widths": [256, 384, 256, 128, 32], "micro_batch": 32, "warmup": 20, "steps": 300},
    # PEERS.md's small model: 4 layers, width 384, vocab 8192, 8 x 128 tokens per step (4 per rank).
    "gpt": {
        "kind": "gpt",
        "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
        "micro_batch": 4,
        "warmup": 3,
        "steps": 10,
    },
}
QUICK_MODELS: dict[str, dict[str, Any]] = {
    "mlp": {**MODELS["mlp"], "widths": [16, 32, 8], "micro_batch": 4, "warmup": 1, "steps": 3},
    "gpt": {
        "kind": "gpt",
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "warmup": 1,
        "steps": 3,
    },
}


def zero_blocks(n_embd: int) -> dict[str, dict[str, Any]]:
    """zeroshard's and DeepSpeed's ``zero_optimization`` blocks, by system (without its runner prefix).

    Stage 3 prefetches about two GPT blocks (12 * n_embd^2 each)."""
    block = 12 * n_embd * n_embd
    stage3 = {
        "stage": 3,
        "stage3_param_persistence_threshold": 10_000,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 2 * block,
    }
    return {
        "stage0": {"stage": 0},
        "stage1": {"stage": 1},
        "stage2": {"stage": 2},
        "stage3": stage3,
        # DeepSpeed's stage3_module_granularity_threshold at a block's granularity (parameters over its 9
        # parameterised modules): each transformer block becomes one unit, gathered by the block.
        "stage3-blocks": {**stage3, "stage3_module_granularity_threshold": (block + 13 * n_embd) // 9 + 1},
        "stage3-ds-defaults": {
            "stage": 3,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
        },
    }


def build_mlp(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on both ranks
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------------------------- workers


def _library(rank: int, runner: str) -> Any:
    """zeroshard or DeepSpeed, imported before the RSS baseline; None for DDP."""
    if runner == "deepspeed":
        # DeepSpeed reads these even when the process group is already up (it asserts on LOCAL_RANK).
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        import deepspeed

        return deepspeed
    if runner == "zeroshard":
        import zeroshard

        return zeroshard
    return None


def _batches(rank: int, model: dict[str, Any], n_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model["kind"] == "gpt":
        tokens = tokens_for(rank, n_steps, model["micro_batch"], model["model"])
        return [(tokens[i, :, :-1], tokens[i, :, 1:]) for i in range(n_steps)]
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    widths = model["widths"]
    return [
        (
            torch.randn(model["micro_batch"], widths[0], generator=g),
            torch.randn(model["micro_batch"], widths[-1]),
        )
        for _ in range(n_steps)
    ]


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """One system on one model on one rank: build, warm up, time the steps. Collective: both ranks run it."""
    runner, system = run["runner"], run["system"]
    spec = run["model"]
    library = _library(rank, runner)
    baseline = rss()
    gpt = spec["kind"] == "gpt"
    model = build_gpt(spec["model"]) if gpt else build_mlp(spec["widths"])

    def loss_of(module: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return module(x, y) if gpt else nn.functional.mse_loss(module(x), y)

    engine: Any = None
    if library is None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        cfg = ds_config(run["zero"], spec["micro_batch"])
        extra: dict[str, Any] = {}
        if runner == "deepspeed":
            extra["dist_init_required"] = False
            cfg["optimizer"]["params"]["torch_adam"] = True  # no fused Adam op on CPU (DS_BUILD_OPS=0)
        engine, _, _, _ = library.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, **extra
        )
    n_steps = spec["warmup"] + spec["steps"]
    batches = _batches(rank, spec, n_steps)
    state = 0

    def step(i: int) -> float:
        nonlocal state
        x, y = batches[i]
        if engine is not None:
            loss = loss_of(engine, x, y)
            engine.backward(loss)
            engine.step()
        else:
            loss = loss_of(ddp, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            if i == n_steps - 1:  # gradients are still allocated: count them with the rest of the state
                state = reachable_tensor_bytes([list(model.parameters()), opt])
            opt.zero_grad()
        return float(loss.item())

    for i in range(spec["warmup"]):
        step(i)
    dist.barrier()
    calls0 = dict(engine.comm.stats.calls_by_op) if runner == "zeroshard" else {}
    control0 = engine.comm.stats.control_calls if runner == "zeroshard" else 0
    bytes0 = engine.comm.stats.total_bytes if runner == "zeroshard" else 0
    profiler = cProfile.Profile() if run.get("profile") and rank == 0 else None
    times: list[float] = []
    loss = float("nan")
    for i in range(spec["warmup"], n_steps):
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        loss = step(i)
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "system": system,
        "times": times,
        "final_loss": loss,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "peak_rss_above_baseline_bytes": peak_rss() - baseline,
    }
    if runner == "zeroshard":
        stats = engine.comm.stats
        out["model_state_bytes"] = engine.memory_breakdown().total
        out["comm_bytes_per_step"] = (stats.total_bytes - bytes0) / spec["steps"]
        out["comm_calls_per_step_by_op"] = {
            k: (v - calls0.get(k, 0)) / spec["steps"] for k, v in stats.calls_by_op.items()
        }
        # The small control collectives (the step's fused checks, stage 3's agreements): no model bytes.
        out["comm_calls_per_step_by_op"]["control"] = (stats.control_calls - control0) / spec["steps"]
        engine.destroy()
    elif runner == "deepspeed":
        out["model_state_bytes"] = reachable_tensor_bytes([list(model.parameters()), engine.optimizer])
    else:
        out["model_state_bytes"] = state
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(25)
        out["profile"] = s.getvalue()
    return out


# ----------------------------------------------------------------------------------------------- driver


def _median_step(per_rank: list[dict[str, Any]], model: str) -> float:
    """The median over steps of the slower rank's time (a step ends for everyone at its last collective)."""
    return statistics.median(max(ts) for ts in zip(*(x[model]["times"] for x in per_rank), strict=True))


def summarise(rounds: list[dict[str, dict[str, list[dict[str, Any]]]]], model: str) -> dict[str, Any]:
    """Per system on ``model``: step times pooled over rounds; median over rounds of the ratio to DDP."""
    summary: dict[str, Any] = {}
    for name in rounds[0]:
        step_times: list[float] = []
        ratios: list[float] = []
        for rnd in rounds:
            per_step = [max(ts) for ts in zip(*(r[model]["times"] for r in rnd[name]), strict=True)]
            base = [max(ts) for ts in zip(*(r[model]["times"] for r in rnd["ddp"]), strict=True)]
            step_times += per_step
            ratios.append(statistics.median(per_step) / statistics.median(base))
        last = rounds[-1][name]
        summary[name] = {
            "median_s": statistics.median(step_times),
            "min_s": min(step_times),
            "max_s": max(step_times),
            "ratio_to_ddp_per_round": ratios,
            "ratio_to_ddp": statistics.median(ratios),
            "num_parameters": last[0][model]["num_parameters"],
            "model_state_bytes": max(r[model]["model_state_bytes"] for r in last),
            "comm_calls_per_step_by_op": last[0][model].get("comm_calls_per_step_by_op"),
            "comm_bytes_per_step": last[0][model].get("comm_bytes_per_step"),
            "peak_rss_above_baseline_bytes": max(
                r[model]["peak_rss_above_baseline_bytes"] for rnd in rounds for r in rnd[name]
            ),
            "final_loss": last[0][model]["final_loss"],
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps, one round (smoke test)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "gpt"])
    parser.add_argument("--deepspeed-python", help="interpreter with DeepSpeed installed: adds its rows")
    parser.add_argument(
        "--stage3-variants", action="store_true", help="also zeroshard stage 3 with a unit per GPT block"
    )
    parser.add_argument("--only", nargs="+", metavar="SYSTEM", help="run only these systems (and ddp)")
    parser.add_argument("--profile", metavar="SYSTEM", help="cProfile rank 0 of SYSTEM's last round")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/step_time[_quick].json)")
    parser.add_argument("--rank", nargs=3, metavar=("RANK", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:  # one rank of a run (common.run_ranks)
        rank_main(worker, int(args.rank[0]), args.rank[1], args.rank[2])
        return

    models = {k: (QUICK_MODELS if args.quick else MODELS)[k] for k in args.models}
    rounds_n = args.rounds or (1 if args.quick else 3)
    n_embd = models["gpt"]["model"]["n_embd"] if "gpt" in models else 384
    blocks = zero_blocks(n_embd)
    # Stage 3 twice: every parameter above 1e4 elements sharded, and at DeepSpeed's defaults.
    kinds = ["stage0", "stage1", "stage2", "stage3", "stage3-ds-defaults"]
    systems: dict[str, tuple[str, dict[str, Any]]] = {"ddp": ("torch", {})}
    systems.update({f"zeroshard-{k}": ("zeroshard", blocks[k]) for k in kinds})
    if args.stage3_variants:
        systems["zeroshard-stage3-blocks"] = ("zeroshard", blocks["stage3-blocks"])
    if args.deepspeed_python:
        systems.update({f"deepspeed-{k}": ("deepspeed", blocks[k]) for k in kinds})
    if args.only:
        systems = {k: v for k, v in systems.items() if k == "ddp" or k in args.only}
    out_path = args.out or RESULTS / ("step_time_quick.json" if args.quick else "step_time.json")
    script = str(Path(__file__).resolve())

    def python_for(runner: str) -> str:
        return args.deepspeed_python if runner == "deepspeed" else sys.executable

    def runs_for(name: str, last: bool) -> list[dict[str, Any]]:
        runner, zero = systems[name]
        return [
            {
                "runner": runner,
                "system": name,
                "model": spec,
                "zero": zero,
                "profile": last and name == args.profile,
            }
            for spec in models.values()
        ]

    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    t_start = time.time()
    load_before = os.getloadavg()
    rounds: list[dict[str, dict[str, list[dict[str, Any]]]]] = []
    for r in range(rounds_n):
        rnd: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for name, (runner, _) in systems.items():
            t0 = time.time()
            spec = {"name": name, "runs": runs_for(name, r == rounds_n - 1)}
            per_rank = run_ranks(python_for(runner), script, spec, timeout=900, env=env)
            # per system: per rank, per model
            rnd[name] = [dict(zip(models, results, strict=True)) for results in per_rank]
            meds = ", ".join(f"{m} {1e3 * _median_step(rnd[name], m):.1f} ms" for m in models)
            print(f"round {r + 1}/{rounds_n} {name:>28}: {meds} ({time.time() - t0:.1f} s wall)", flush=True)
        rounds.append(rnd)

    summaries = {m: summarise(rounds, m) for m in models}
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmark_tables

    text = benchmark_tables.step_time_rows(summaries)
    print(f"\nW={WORLD_SIZE}, gloo, fp32 AdamW, clipping 1.0; median of the slower rank's step\n")
    print(text + "\n")
    profiles = [
        f"--- {name} on {m} (rank 0, timed steps) ---\n{x[m]['profile']}"
        for name, per_rank in rounds[-1].items()
        for x in per_rank[:1]
        for m in models
        if "profile" in x[m]
    ]
    for p in profiles:
        print(p)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "command": " ".join(["bench/step_time.py", *sys.argv[1:]]),
                "settings": {
                    "models": models,
                    "rounds": rounds_n,
                    "world_size": WORLD_SIZE,
                    "backend": "gloo",
                    "systems": {k: {"runner": v[0], "zero_optimization": v[1]} for k, v in systems.items()},
                    "config": ds_config({"stage": "<system>"}, 0),
                    "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")},
                    "deepspeed_python": args.deepspeed_python,
                },
                "machine": {
                    "platform": platform.platform(),
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "cpus": os.cpu_count(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                    "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg(),
                },
                "started": datetime.datetime.fromtimestamp(t_start).isoformat(timespec="seconds"),
                "wall_s": time.time() - t_start,
                "summary": summaries,
                "table_markdown": text,
                "profiles": profiles,
                "raw": rounds,
            },
            indent=1,
        )
    )
    shown = out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path
    print(f"\nwrote {shown} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
