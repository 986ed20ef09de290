"""Step time with NVMe offload against in memory, and how much of the I/O the step hides (issue 6, bench 3).

    .venv/bin/python bench/offload.py            # GPT of ~48M parameters, stage 3, 2 gloo ranks
    .venv/bin/python bench/offload.py --quick    # tiny model, a smoke test (< 1 min)
    ZEROSHARD_BENCH_NVME=/mnt/nvme .venv/bin/python bench/offload.py   # the offload files' directory

Variants, interleaved over rounds (each run in a fresh pair of spawned processes): stage 3 in memory;
stage 3 with the optimizer (fp32 masters and Adam's moments) on NVMe; the same plus the parameter shards on
NVMe. Per variant: median step time (slowest rank), its ratio to in memory, bytes read and written per step
per rank, the time the store was busy reading and writing, the time training waited for it (the optimizer
step's sub-group reads and writes, the gathers' parameter reads), and the share of the I/O time that was
hidden behind compute: ``1 - waited / busy``. Raw results go to ``bench/results/offload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import build_gpt, ds_config, peak_rss, run_pair, tokens_for

# isort: split
import torch
import torch.distributed as dist

import zeroshard

FULL = {
    "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 6, "n_head": 12, "n_embd": 768},
    "micro_batch": 4,
    "warmup": 2,
    "steps": 4,
    "rounds": 2,
}
QUICK = {
    "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
    "micro_batch": 2,
    "warmup": 1,
    "steps": 2,
    "rounds": 1,
}


def variants(n_embd: int, nvme: str) -> dict[str, dict[str, Any]]:
    block = 12 * n_embd * n_embd
    stage3 = {
        "stage": 3,
        "stage3_param_persistence_threshold": 10_000,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 2 * block,
        "sub_group_size": 4 * n_embd * n_embd,
    }
    on_nvme = {"device": "nvme", "nvme_path": nvme}
    return {
        "in memory": stage3,
        "optimizer on NVMe": {**stage3, "offload_optimizer": on_nvme},
        "optimizer + params on NVMe": {**stage3, "offload_optimizer": on_nvme, "offload_param": on_nvme},
    }


def _io(engine: Any) -> dict[str, float]:
    """Bytes and seconds of the offload stores so far, and the time training waited for them."""
    out = {"read": 0.0, "written": 0.0, "busy_s": 0.0, "waited_s": 0.0}
    swapper, params = engine.offload.optimizer_swapper, engine.offload.param_store
    for store in [s.store for s in (swapper, params) if s is not None]:
        out["read"] += store.stats.bytes_read
        out["written"] += store.stats.bytes_written
        out["busy_s"] += store.stats.read_seconds + store.stats.write_seconds
    out["waited_s"] = (swapper.io_wait_s if swapper else 0.0) + (params.io_wait_s if params else 0.0)
    return out


def worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    model = build_gpt(spec["model"])
    engine, *_ = zeroshard.initialize(model=model, config=ds_config(spec["zero"], spec["micro_batch"]))
    tokens = tokens_for(rank, spec["warmup"] + spec["steps"], spec["micro_batch"], spec["model"])

    def step(i: int) -> None:
        loss = engine(tokens[i, :, :-1], tokens[i, :, 1:])
        engine.backward(loss)
        engine.step()

    for i in range(spec["warmup"]):
        step(i)
    dist.barrier()
    io0, times = _io(engine), []
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    io1 = _io(engine)
    engine.destroy()
    return {
        "times": times,
        "io_per_step": {k: (io1[k] - io0[k]) / spec["steps"] for k in io0},
        "parameters": sum(u.numel for u in engine.units),
        "peak_rss": peak_rss(),
    }


def summarise(rounds: list[dict[str, list[dict[str, Any]]]], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        per_step, ratios = [], []
        for rnd in rounds:
            mine = [max(ts) for ts in zip(*(r["times"] for r in rnd[name]), strict=True)]
            base = [max(ts) for ts in zip(*(r["times"] for r in rnd[names[0]]), strict=True)]
            per_step += mine
            ratios.append(statistics.median(mine) / statistics.median(base))
        io = [r["io_per_step"] for rnd in rounds for r in rnd[name]]
        busy = statistics.mean(x["busy_s"] for x in io)
        waited = statistics.mean(x["waited_s"] for x in io)
        out[name] = {
            "median_step_s": statistics.median(per_step),
            "ratio_to_in_memory": statistics.median(ratios),
            "read_bytes_per_step_per_rank": statistics.mean(x["read"] for x in io),
            "written_bytes_per_step_per_rank": statistics.mean(x["written"] for x in io),
            "io_busy_s_per_step": busy,
            "io_waited_s_per_step": waited,
            "io_hidden_share": (1.0 - waited / busy) if busy > 0 else None,
            "peak_rss_bytes": max(r["peak_rss"] for rnd in rounds for r in rnd[name]),
            "parameters": rounds[0][name][0]["parameters"],
        }
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| variant | median step (s) | × in memory | read / written per step per rank (MB) "
        "| I/O busy / waited per step (s) | I/O hidden | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        hidden = "-" if s["io_hidden_share"] is None else f"{s['io_hidden_share']:.0%}"
        read, written = s["read_bytes_per_step_per_rank"], s["written_bytes_per_step_per_rank"]
        lines.append(
            f"| {name} | {s['median_step_s']:.2f} | {s['ratio_to_in_memory']:.2f} | "
            f"{read / 1e6:.0f} / {written / 1e6:.0f} | "
            f"{s['io_busy_s_per_step']:.2f} / {s['io_waited_s_per_step']:.2f} | {hidden} | "
            f"{s['peak_rss_bytes'] / 1e6:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke test")
    parser.add_argument("--json", default=None, help="where to write the results")
    args = parser.parse_args()
    base = QUICK if args.quick else FULL
    out_path = Path(args.json or f"bench/results/offload{'_quick' if args.quick else ''}.json")
    with tempfile.TemporaryDirectory(dir=os.environ.get("ZEROSHARD_BENCH_NVME")) as nvme:
        names_zero = variants(base["model"]["n_embd"], nvme)
        names = list(names_zero)
        rounds = []
        for r in range(base["rounds"]):
            results = {}
            for name in names:
                run = {**base, "zero": names_zero[name]}
                pair = run_pair(worker, {"name": name, "runs": [run]})
                results[name] = [runs[0] for runs in pair]
                print(f"round {r + 1}: {name}: {statistics.median(results[name][0]['times']):.2f} s/step")
            rounds.append(results)
    summary = summarise(rounds, names)
    print(table(summary))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": base["model"], "micro_batch": base["micro_batch"], "torch": torch.__version__}
    out_path.write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
