"""Soak: long training at W = 2 with periodic checkpoints; does any resource grow with the step count?

    .venv/bin/python bench/soak.py            # 1000 steps, a save every 50 (keep_last 2), ZeRO stage 2
    .venv/bin/python bench/soak.py --quick    # 40 steps, a save every 10: a smoke test of the plumbing
    .venv/bin/python bench/soak.py --steps 5000 --save-every 100 --stage 3

Two gloo ranks train a small MLP (AdamW, fp32) and call ``save_checkpoint(keep_last=N)`` every K steps into a
temporary directory. After every save (and at step 0) each rank samples its own resident set size, its open
file descriptors and its thread count (psutil). The figures that matter are the differences between the
first sample after the first save (when allocator pools, gloo's buffers and the checkpoint writer's threads
exist) and the last one: a leak of a buffer per step, a file left open per save or a thread per save shows
there. Prints a table and writes ``bench/results/soak.json`` (``soak_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, run_pair  # sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported

# isort: split
import psutil
import torch
from torch import nn

MIB = 2**20
WIDTH = 256
DEPTH = 4
MICRO_BATCH = 8


def _sample(step: int) -> dict[str, int]:
    proc = psutil.Process()
    return {
        "step": step,
        "rss": proc.memory_info().rss,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
    }


def soak_worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """One rank's soak: train, save every ``save_every`` steps, sample after each save. Collective."""
    import zeroshard

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": run["stage"]},
    }
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(rank)
    samples = [_sample(0)]
    losses = []
    start = time.perf_counter()
    for step in range(1, run["steps"] + 1):
        x = torch.randn(MICRO_BATCH, WIDTH, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if step % run["save_every"] == 0:
            engine.save_checkpoint(run["save_dir"], keep_last=run["keep_last"])
            samples.append(_sample(step))
    wall = time.perf_counter() - start
    kept = sorted(p.name for p in Path(run["save_dir"]).iterdir() if p.is_dir())
    engine.destroy()
    return {
        "samples": samples,
        "wall_s": wall,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "kept_tags": kept,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank: growth of RSS, descriptors and threads from the first sample after a save to the last."""
    out = {}
    for rank, result in enumerate(per_rank):
        s = result["samples"]
        base, last = s[1], s[-1]  # s[0] is before the first step: no pools, no writer yet
        out[f"rank{rank}"] = {
            "rss_at_start_mib": s[0]["rss"] / MIB,
            "rss_after_first_save_mib": base["rss"] / MIB,
            "rss_at_end_mib": last["rss"] / MIB,
            "rss_growth_after_first_save_mib": (last["rss"] - base["rss"]) / MIB,
            "rss_max_minus_min_after_first_save_mib": (
                max(x["rss"] for x in s[1:]) - min(x["rss"] for x in s[1:])
            )
            / MIB,
            "fds_after_first_save": base["fds"],
            "fds_range_after_first_save": [min(x["fds"] for x in s[1:]), max(x["fds"] for x in s[1:])],
            "threads_after_first_save": base["threads"],
            "threads_range_after_first_save": [
                min(x["threads"] for x in s[1:]),
                max(x["threads"] for x in s[1:]),
            ],
        }
    return out


def table(per_rank: list[dict[str, Any]]) -> str:
    lines = [
        "| step | rank 0 RSS (MiB) | rank 1 RSS (MiB) | rank 0 fds | rank 1 fds | rank 0 threads | "
        "rank 1 threads |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(per_rank[0]["samples"], per_rank[1]["samples"], strict=True):
        lines.append(
            f"| {a['step']} | {a['rss'] / MIB:.1f} | {b['rss'] / MIB:.1f} | {a['fds']} | {b['fds']} | "
            f"{a['threads']} | {b['threads']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps, a save every 10 (smoke test)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 1000; --quick 40)")
    parser.add_argument("--save-every", type=int, help="steps between saves (default 50; --quick 10)")
    parser.add_argument("--keep-last", type=int, default=2, help="save_checkpoint(keep_last=N) (default 2)")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (default 2)")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/soak[_quick].json)")
    args = parser.parse_args()
    steps = args.steps or (40 if args.quick else 1000)
    save_every = args.save_every or (10 if args.quick else 50)
    if steps < 1 or save_every < 1 or args.keep_last < 1:
        parser.error(
            f"--steps ({steps}), --save-every ({save_every}), --keep-last ({args.keep_last}) must be >= 1"
        )
    if steps < save_every:
        parser.error(
            f"--steps ({steps}) must be >= --save-every ({save_every}): the soak samples after saves"
        )
    out_path = args.out or ROOT / "bench" / "results" / ("soak_quick.json" if args.quick else "soak.json")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="zeroshard-soak-") as save_dir:
        run = {
            "stage": args.stage,
            "steps": steps,
            "save_every": save_every,
            "keep_last": args.keep_last,
            "save_dir": save_dir,
        }
        per_rank = [r[0] for r in run_pair(soak_worker, {"name": "soak", "runs": [run]}, timeout=3600)]
    del run["save_dir"]
    summary = summarize(per_rank)
    text = table(per_rank)
    print(
        f"soak: W=2 gloo, ZeRO stage {args.stage}, MLP of {per_rank[0]['parameters']:,} parameters, "
        f"{steps} steps, a save every {save_every} (keep_last {args.keep_last}), "
        f"{per_rank[0]['wall_s']:.0f} s on rank 0\n"
    )
    print(text)
    print()
    for rank, row in summary.items():
        print(
            f"{rank}: RSS {row['rss_after_first_save_mib']:.1f} -> {row['rss_at_end_mib']:.1f} MiB after the "
            f"first save ({row['rss_growth_after_first_save_mib']:+.1f} MiB), fds "
            f"{row['fds_range_after_first_save']}, threads {row['threads_range_after_first_save']}"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            {
                "settings": {**run, "width": WIDTH, "depth": DEPTH, "micro_batch": MICRO_BATCH},
                "machine": {
                    "platform": platform.platform(),
                    "torch": torch.__version__,
                    "cpus": os.cpu_count(),
                },
                "wall_s": time.time() - t0,
                "summary": summary,
                "ranks": per_rank,
                "table_markdown": text,
            },
            indent=1,
        )
    )
    print(f"\nwrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path}")


if __name__ == "__main__":
    main()
