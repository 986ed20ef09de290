"""Step time of zeroshard stages 0-3 on the demo GPT, two gloo processes on CPU (issue 3's benchmark).

    .venv/bin/python bench/step_time.py            # full run (~13.4M-parameter GPT, several rounds)
    .venv/bin/python bench/step_time.py --quick    # tiny model, 3 steps, one round: a smoke test (< 30 s)
    .venv/bin/python bench/step_time.py --profile [VARIANT]  # also cProfile rank 0 of one run (stage3)

Every (round, variant) runs in a fresh pair of spawned processes (``file://`` rendezvous, gloo,
``OMP_NUM_THREADS=1``), so peak RSS is that variant's alone. Variants are interleaved (stage0, stage1,
stage2, stage3, stage3-ds-defaults, stage0, ...) so that drift on a shared machine cancels in the ratios to
stage 0, which are taken within each round and then summarised by their median.

Per variant and round the workers report: per-step wall times after warm-up (slowest rank per step, since a
step ends for everyone at the last collective), ``engine.memory_breakdown()``, bytes communicated per step
(``engine.comm.stats``) and peak RSS above a baseline taken after ``init_process_group`` and before the
model is built. Raw results go to ``bench/results/step_time.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import ROOT, WORLD_SIZE, ds_config, rss, run_pair

# isort: split
import psutil
import torch
import torch.distributed as dist
from train_gpt import GPT, GPTConfig

import zeroshard

# PEERS.md's small model: 4 layers, width 384, vocab 8192, 8 x 128 tokens per step (4 per rank).
FULL = {
    "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
    "micro_batch": 4,
    "warmup": 3,
    "steps": 10,
    "rounds": 3,
}
QUICK = {
    "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
    "micro_batch": 2,
    "warmup": 1,
    "steps": 3,
    "rounds": 1,
}


def variants(n_embd: int) -> dict[str, dict[str, Any]]:
    """zero_optimization blocks, by variant name. Stage 3 prefetches about two blocks (12 * n_embd^2 each)."""
    block = 12 * n_embd * n_embd
    return {
        "stage0": {"stage": 0},
        "stage1": {"stage": 1},
        "stage2": {"stage": 2},
        "stage3": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10_000,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 2 * block,
        },
        # DeepSpeed's stage3_module_granularity_threshold at a block's granularity (parameters over its
        # 9 parameterised modules): each transformer block becomes one unit, gathered by the block.
        "stage3-blocks": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10_000,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 2 * block,
            "stage3_module_granularity_threshold": (12 * n_embd * n_embd + 13 * n_embd) // 9 + 1,
        },
        "stage3-ds-defaults": {
            "stage": 3,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_reuse_distance": 1_000_000_000,
            "stage3_prefetch_bucket_size": 50_000_000,
        },
    }


_BASELINE: int | None = None


def worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One variant on one rank: build, warm up, time ``steps`` steps. Collective: both ranks run it."""
    global _BASELINE
    if _BASELINE is None:  # the process's first run: measured before any model was built
        _BASELINE = rss()
    baseline = _BASELINE
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    cfg = GPTConfig(**spec["model"])
    torch.manual_seed(0)  # identical initial weights on both ranks
    model = GPT(cfg)
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(spec["zero"], spec["micro_batch"])
    )
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own synthetic tokens
    n = spec["micro_batch"]
    tokens = torch.randint(
        cfg.vocab_size, (spec["warmup"] + spec["steps"], n, cfg.block_size + 1), generator=g
    )

    def step(i: int) -> float:
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    for i in range(spec["warmup"]):
        step(i)
    dist.barrier()
    bytes0 = engine.comm.stats.total_bytes
    by_op0 = dict(engine.comm.stats.bytes_by_op)
    calls0 = dict(engine.comm.stats.calls_by_op)
    times: list[float] = []
    profiler = cProfile.Profile() if spec.get("profile") and rank == 0 else None
    loss = float("nan")
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        loss = step(i)
        if profiler is not None:
            profiler.disable()
        times.append(time.perf_counter() - t0)
    steps = spec["steps"]
    stats = engine.comm.stats
    mb = engine.memory_breakdown()
    out: dict[str, Any] = {
        "times": times,
        "final_loss": loss,
        "num_parameters": mb.num_parameters,
        "model_state_bytes": {
            "parameters": mb.parameters,
            "gradients": mb.gradients,
            "optimizer_state": mb.optimizer_state,
            "communication_buffers": mb.communication_buffers,
            "total": mb.total,
        },
        "comm_bytes_per_step": (stats.total_bytes - bytes0) / steps,
        "comm_bytes_per_step_by_op": {
            k: (v - by_op0.get(k, 0)) / steps for k, v in stats.bytes_by_op.items()
        },
        "comm_calls_per_step_by_op": {
            k: (v - calls0.get(k, 0)) / steps for k, v in stats.calls_by_op.items()
        },
        "rss_baseline_bytes": baseline,
        "peak_rss_above_baseline_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline,
        "peak_rss_was_already_above_baseline": peak_before > baseline,
    }
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("tottime").print_stats(25)
        out["profile_tottime"] = s.getvalue()
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats(35)
        out["profile_cumulative"] = s.getvalue()
    return out


def summarise(rounds: list[dict[str, list[dict[str, Any]]]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per variant: step times pooled over rounds; median over rounds of the in-round ratio to stage 0."""
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        step_times: list[float] = []
        ratios: list[float] = []
        for rnd in rounds:
            # A step is done when the slowest rank is done.
            per_step = [max(ts) for ts in zip(*(r["times"] for r in rnd[name]), strict=True)]
            base = [max(ts) for ts in zip(*(r["times"] for r in rnd["stage0"]), strict=True)]
            step_times += per_step
            ratios.append(statistics.median(per_step) / statistics.median(base))
        r0 = rounds[-1][name][0]
        summary[name] = {
            "median_s": statistics.median(step_times),
            "min_s": min(step_times),
            "max_s": max(step_times),
            "ratio_to_stage0_per_round": ratios,
            "ratio_to_stage0": statistics.median(ratios),
            "model_state_bytes_per_rank": [
                rnd[name][k]["model_state_bytes"]["total"] for rnd in rounds[-1:] for k in range(WORLD_SIZE)
            ],
            "comm_bytes_per_step": r0["comm_bytes_per_step"],
            "peak_rss_above_baseline_bytes": max(
                rnd[name][k]["peak_rss_above_baseline_bytes"] for rnd in rounds for k in range(WORLD_SIZE)
            ),
        }
    return summary


def table(summary: dict[str, dict[str, Any]]) -> str:
    mib = 1024 * 1024
    lines = [
        "| variant | median step (s) | min / max (s) | × stage 0 (per round) | model state / rank (MiB) "
        "| comm / step (MiB) | peak RSS above baseline (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        per_round = ", ".join(f"{r:.2f}" for r in s["ratio_to_stage0_per_round"])
        state = max(s["model_state_bytes_per_rank"]) / mib
        lines.append(
            f"| {name} | {s['median_s']:.3f} | {s['min_s']:.3f} / {s['max_s']:.3f} "
            f"| **{s['ratio_to_stage0']:.2f}** ({per_round}) | {state:.1f} "
            f"| {s['comm_bytes_per_step'] / mib:.1f} | {s['peak_rss_above_baseline_bytes'] / mib:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, one round (smoke test)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 10; 3 with --quick)")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="stage3",
        metavar="VARIANT",
        help="cProfile rank 0 of the last run of VARIANT (default stage3)",
    )
    parser.add_argument("--only", nargs="+", help="run only these variants (stage0 is always included)")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/step_time[_quick].json)")
    args = parser.parse_args()

    base = dict(QUICK if args.quick else FULL)
    if args.rounds:
        base["rounds"] = args.rounds
    if args.steps:
        base["steps"] = args.steps
    all_variants = variants(base["model"]["n_embd"])
    names = list(all_variants) if not args.only else ["stage0"] + [n for n in args.only if n != "stage0"]
    out_path = args.out or ROOT / "bench" / "results" / (
        "step_time_quick.json" if args.quick else "step_time.json"
    )

    t_start = time.time()
    load_before = os.getloadavg()
    rounds: list[dict[str, list[dict[str, Any]]]] = []

    def spec_for(name: str, r: int) -> dict[str, Any]:
        return {
            "name": name,
            "model": base["model"],
            "micro_batch": base["micro_batch"],
            "warmup": base["warmup"],
            "steps": base["steps"],
            "zero": all_variants[name],
            "profile": name == args.profile and r == base["rounds"] - 1,
        }

    def show(r: int, name: str, res: list[dict[str, Any]], wall: str) -> None:
        med = statistics.median(max(ts) for ts in zip(*(x["times"] for x in res), strict=True))
        print(f"round {r + 1}/{base['rounds']} {name:>18}: median {med:.3f} s/step{wall}", flush=True)

    rounds: list[dict[str, list[dict[str, Any]]]] = []
    if args.quick:
        # One process pair runs everything in order (spawning costs seconds); peak RSS is then cumulative.
        order = [(r, n) for r in range(base["rounds"]) for n in names]
        per_rank = run_pair(worker, {"name": "quick", "runs": [spec_for(n, r) for r, n in order]})
        for i, (r, name) in enumerate(order):
            if name == names[0]:
                rounds.append({})
            rounds[r][name] = [per_rank[k][i] for k in range(WORLD_SIZE)]
            show(r, name, rounds[r][name], "")
    else:
        # A fresh process pair per (round, variant): peak RSS is that variant's alone.
        for r in range(base["rounds"]):
            rnd: dict[str, list[dict[str, Any]]] = {}
            for name in names:
                t0 = time.time()
                rnd[name] = [x[0] for x in run_pair(worker, {"name": name, "runs": [spec_for(name, r)]})]
                show(r, name, rnd[name], f" ({time.time() - t0:.1f} s wall)")
            rounds.append(rnd)

    summary = summarise(rounds, names)
    text = table(summary)
    n_params = rounds[0]["stage0"][0]["num_parameters"]
    print(
        f"\n{n_params / 1e6:.1f}M parameters, W={WORLD_SIZE}, gloo, fp32 AdamW, clipping 1.0, "
        f"{base['micro_batch']} x {base['model']['block_size']} tokens per rank per step\n"
    )
    print(text + "\n")
    for name in (n for n in names if n.startswith("stage3")):
        ratio = summary[name]["ratio_to_stage0"]
        verdict = "MET" if ratio <= 1.15 else "MISSED"
        if args.quick:
            verdict += " (--quick: tiny model, not a measurement)"
        print(f"target {name} <= 1.15 x stage 0: {verdict} ({ratio:.2f})")
    profile = next(
        (
            x["profile_tottime"] + x["profile_cumulative"]
            for rnd in rounds
            for x in rnd.get(args.profile or "", [])
            if "profile_tottime" in x
        ),
        None,
    )
    if profile:
        print(f"\ncProfile of rank 0, {args.profile}, timed steps:\n" + profile)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "settings": {
                    **base,
                    "world_size": WORLD_SIZE,
                    "backend": "gloo",
                    "variants": {n: all_variants[n] for n in names},
                    "config": ds_config({"stage": "<variant>"}, base["micro_batch"]),
                    "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")},
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
                "num_parameters": n_params,
                "summary": summary,
                "table_markdown": text,
                "profile": profile,
                "raw": rounds,
            },
            indent=1,
        )
    )
    print(
        f"\nwrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path} "
        f"({time.time() - t_start:.0f} s)"
    )


if __name__ == "__main__":
    main()
