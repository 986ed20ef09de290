"""ZeRO++'s quantized collectives: the bytes they save and what they cost the loss curve.

    .venv/bin/python bench/quantized.py           # 300 steps per run, six runs (~3-5 min on 2 cores)
    .venv/bin/python bench/quantized.py --quick   # 20 steps: a smoke test

Model: examples/train_gpt.py's GPT (2 layers, width 256, vocab 2048, block 64), trained at stage 3 for
``steps`` steps on its Markov-chain language (``MarkovLanguage``: the loss can fall from ln(2048) = 7.6 to
the chain's entropy), AdamW at lr 1e-3 with clipping at 1.0, 4 sequences of 64 tokens per rank per step, W=2
gloo ranks on this machine's CPUs (every unit released after its forward, so each is gathered twice per
step). One run per row, each from the same initial weights and the same batches:

* plain stage 3, ``zero_quantized_weights`` (qwZ), ``zero_quantized_gradients`` (qgZ) and both, in fp32;
  plain and both in bf16.
* bytes per step: ``engine.communication_bytes()`` by operation (parameter all-gathers, gradient
  reduce-scatters), and their fraction of the plain run's of the same precision;
* the loss curve: the mean loss of the last 20 steps, and the largest gap between the run's loss and the
  plain run's at any step (each curve smoothed over 10 steps first: the batches are the same, the noise
  mostly is too).

The quantized collectives are lossy by design (core/quantize.py [Note: quantized collectives]): these
figures say by how much on this model. Raw results, with the curves every 10 steps:
``bench/results/quantized.json``; ``make benchmarks-page`` puts the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import CLIP, LR, ROOT, WEIGHT_DECAY, WORLD_SIZE, build_gpt, run_pair

# isort: split
import torch

import zeroshard

RESULTS = ROOT / "bench" / "results"
MODEL = {"vocab_size": 2048, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 256}
MICRO_BATCH = 4
SMOOTH = 10  # steps each curve is averaged over before the gap is taken
TAIL = 20  # steps the final loss is the mean of

ROWS: dict[str, tuple[str, dict[str, bool]]] = {
    "fp32": ("fp32", {}),
    "fp32-qwz": ("fp32", {"zero_quantized_weights": True}),
    "fp32-qgz": ("fp32", {"zero_quantized_gradients": True}),
    "fp32-both": ("fp32", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
    "bf16": ("bf16", {}),
    "bf16-both": ("bf16", {"zero_quantized_weights": True, "zero_quantized_gradients": True}),
}


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """Train one row; this rank's losses, bytes by operation and step times. Collective."""
    from train_gpt import MarkovLanguage

    precision, flags = ROWS[run["row"]]
    steps = run["steps"]
    zero = {"stage": 3, "stage3_max_reuse_distance": 0, **flags}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
    }
    engine, *_ = zeroshard.initialize(model=build_gpt(MODEL), config=config)
    data = MarkovLanguage(
        vocab_size=MODEL["vocab_size"],
        block_size=MODEL["block_size"],
        num_sequences=steps * MICRO_BATCH * WORLD_SIZE,
    )
    losses, times = [], []
    for step in range(steps):
        first = (step * WORLD_SIZE + rank) * MICRO_BATCH
        x, y = (
            torch.stack(t) for t in zip(*(data[i] for i in range(first, first + MICRO_BATCH)), strict=True)
        )
        start = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    stats = engine.comm.stats
    return {
        "losses": losses,
        "bytes_by_op": {op: n / steps for op, n in stats.bytes_by_op.items()},
        "step_s": statistics.median(times[1:] or times),
    }


def _smooth(xs: list[float]) -> list[float]:
    return [statistics.fmean(xs[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(xs))]


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per row: the mean loss over ranks at each step, its tail, the gap to the plain run, bytes per step."""
    out: dict[str, dict[str, Any]] = {}
    for name, per_rank in runs.items():
        losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in per_rank), strict=True)]
        out[name] = {
            "losses": losses,
            "final_loss": statistics.fmean(losses[-TAIL:]),
            "bytes_by_op": per_rank[0]["bytes_by_op"],
            "step_s": max(r["step_s"] for r in per_rank),
        }
    for name, row in out.items():
        plain = out[ROWS[name][0]]
        gap = max(abs(a - b) for a, b in zip(_smooth(row["losses"]), _smooth(plain["losses"]), strict=True))
        row["max_gap_to_plain"] = gap
        row["final_loss_vs_plain"] = row["final_loss"] / plain["final_loss"] - 1
        row["bytes_fraction_of_plain"] = {
            op: row["bytes_by_op"].get(op, 0) / n for op, n in plain["bytes_by_op"].items() if n
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 steps per run (smoke test)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/quantized.json)")
    args = parser.parse_args()
    steps = 20 if args.quick else args.steps
    out_path = args.out or RESULTS / ("quantized_quick.json" if args.quick else "quantized.json")
    started = time.perf_counter()
    runs = {}
    for name in ROWS:
        spec = {"name": f"quantized {name}", "runs": [{"row": name, "steps": steps}]}
        runs[name] = [r[0] for r in run_pair(worker, spec, timeout=1200)]
        print(f"{name}: done", flush=True)
    summary = summarise(runs)
    doc = {
        "command": "bench/quantized.py" + (" --quick" if args.quick else ""),
        "date": datetime.date.today().isoformat(),
        "world_size": WORLD_SIZE,
        "model": MODEL,
        "micro_batch": MICRO_BATCH,
        "steps": steps,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "wall_s": time.perf_counter() - started,
        "rows": {
            name: {**{k: v for k, v in row.items() if k != "losses"}, "loss_every_10": row["losses"][::10]}
            for name, row in summary.items()
        },
    }
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmark_tables

    print(benchmark_tables.quantized(lambda _: doc))
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
