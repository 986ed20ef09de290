"""Compiled vs eager step time of zeroshard stages 0-3 on the demo GPT, two gloo processes on CPU.

    .venv/bin/python bench/compile.py            # small GPT (4 layers, width 384), inductor, stages 0-3
    .venv/bin/python bench/compile.py --quick    # tiny model, aot_eager, a smoke test

Each (stage, mode) runs in a fresh pair of spawned processes: ``initialize`` on the model, then for the
compiled rows ``engine.compile(backend=...)``. The first ``warmup`` steps (compilation, and at stage 3 the
second round of graphs once the parameters' first use is known) are left out of the timing; the table gives
the median step of the rest, the slowest rank per step. It also reports how many distinct graphs dynamo
made and whether that number still changed during the timed steps (it must not). Results go to
``bench/results/compile.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS before torch is imported.
from common import ROOT, build_gpt, ds_config, run_pair, tokens_for

# isort: split
import torch

import zeroshard

FULL = {
    "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
    "micro_batch": 4,
    "warmup": 3,
    "steps": 8,
    "backend": "inductor",
}
QUICK = {
    "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
    "micro_batch": 2,
    "warmup": 2,
    "steps": 2,
    "backend": "aot_eager",
}


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    model = build_gpt(run["model"])
    zero = {"stage": run["stage"], "stage3_param_persistence_threshold": 0}
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(zero, run["micro_batch"])
    )
    if run["compiled"]:
        engine.compile(backend=run["backend"])
    tokens = tokens_for(rank, run["warmup"] + run["steps"], run["micro_batch"], run["model"])
    times, graphs = [], []
    for step in range(run["warmup"] + run["steps"]):
        start = time.perf_counter()
        batch = tokens[step]
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        times.append(time.perf_counter() - start)
        graphs.append(counters["stats"]["unique_graphs"])
    return {"times": times[run["warmup"] :], "graphs": graphs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile.json"))
    args = parser.parse_args()
    base = dict(QUICK if args.quick else FULL)
    if args.backend:
        base["backend"] = args.backend
    rows = []
    for stage in (0, 1, 2, 3):
        row: dict[str, Any] = {"stage": stage}
        for compiled in (False, True):
            run = {**base, "stage": stage, "compiled": compiled, "name": f"stage{stage}-{compiled}"}
            per_rank = [r[0] for r in run_pair(worker, {"name": run["name"], "runs": [run]})]
            steps = [max(ts) for ts in zip(*(r["times"] for r in per_rank), strict=True)]
            graphs = per_rank[0]["graphs"]
            key = "compiled" if compiled else "eager"
            row[f"{key}_s"] = statistics.median(steps)
            if compiled:
                row["graphs"] = graphs[-1]
                row["graphs_stable"] = len(set(graphs[base["warmup"] - 1 :])) == 1
        row["speedup"] = row["eager_s"] / row["compiled_s"]
        rows.append(row)
        print(
            f"stage {stage}: eager {row['eager_s'] * 1e3:8.1f} ms  "
            f"compiled {row['compiled_s'] * 1e3:8.1f} ms  x{row['speedup']:.2f}  "
            f"graphs {row['graphs']} (stable after warm-up: {row['graphs_stable']})",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": base, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
