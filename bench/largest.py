"""The largest GPT that trains at W = 2 on this machine: stage 3 in memory against stage 3 with the optimizer
state and the parameters on NVMe (issue 6, bench 4).

    .venv/bin/python bench/largest.py            # two sizes per mode (~100M and ~200M parameters), ~5 min
    .venv/bin/python bench/largest.py --quick    # tiny sizes: a smoke test
    ZEROSHARD_BENCH_NVME=/mnt/nvme .venv/bin/python bench/largest.py
    .venv/bin/python bench/largest.py --verify-layers 40   # then: NVMe at ~520M, against the fit

Method: each mode trains two GPT sizes for two steps (bf16, AdamW, two gloo ranks, the model built under
``zero.Init`` so no rank ever holds all of it) and records each rank's peak RSS (the whole process) and the
bytes it keeps in NVMe files. Peak RSS is linear in the parameter count N, so two sizes give
``peak = fixed + per_param * N``; the largest N is where two ranks' peaks fill the machine's memory (total
RAM, less 2 GiB for the system), and for NVMe also where the two ranks' files fill the free disk under the
offload directory. Training the projected sizes themselves would take tens of minutes and most of the disk.

Note: the GPT is built under ``zero.Init``, where ``GPT._init_weights`` (applied after the submodules are
attached) meets placeholders and does nothing, so the weights keep torch's default initialisation; that
changes nothing about memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss, run_pair, tokens_for

# isort: split
import psutil
import torch

import zeroshard

GIB = 1024**3
SYSTEM_RESERVE = 2 * GIB

FULL = {"sizes": [8, 16], "n_embd": 1024, "n_head": 16, "vocab_size": 8192, "block_size": 64}
QUICK = {"sizes": [1, 2], "n_embd": 128, "n_head": 4, "vocab_size": 512, "block_size": 16}


def zero_block(mode: str, nvme: str, n_embd: int) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "overlap_comm": False,  # one reduce-scatter bucket at a time: the memory-lean setting
        "reduce_bucket_size": 2 * n_embd * n_embd,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 8 * n_embd * n_embd,
        "stage3_max_live_parameters": 24 * n_embd * n_embd,
        "stage3_param_persistence_threshold": 10 * n_embd,
        "sub_group_size": 2 * n_embd * n_embd,
    }
    if mode == "nvme":
        on_nvme = {"device": "nvme", "nvme_path": nvme}
        zero.update(offload_optimizer=on_nvme, offload_param=on_nvme)
    return zero


def worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    from train_gpt import GPT, GPTConfig

    model_cfg = GPTConfig(
        vocab_size=spec["vocab_size"],
        block_size=spec["block_size"],
        n_layer=spec["n_layer"],
        n_head=spec["n_head"],
        n_embd=spec["n_embd"],
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero_block(spec["mode"], spec["nvme"], spec["n_embd"]),
    }
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = GPT(model_cfg)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    tokens = tokens_for(rank, 2, 1, {"vocab_size": spec["vocab_size"], "block_size": spec["block_size"]})
    losses = []
    for i in range(2):
        loss = engine(tokens[i, :, :-1], tokens[i, :, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    mb = engine.memory_breakdown()
    engine.destroy()
    return {
        "parameters": mb.num_parameters,
        "peak_rss": peak_rss(),
        "nvme_bytes": mb.offloaded,
        "losses": losses,
    }


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """``y = fixed + per * x`` through the first and last point."""
    (x0, y0), (x1, y1) = points[0], points[-1]
    per = (y1 - y0) / (x1 - x0)
    return y0 - per * x0, per


def verify(n_layer: int, base: dict[str, Any], path: Path) -> None:
    """Train the NVMe mode at ``n_layer`` layers; record its peak RSS beside the fit's prediction."""
    results = json.loads(path.read_text())
    fit_nvme = results["summary"]["nvme"]
    with tempfile.TemporaryDirectory(dir=os.environ.get("ZEROSHARD_BENCH_NVME")) as nvme:
        spec = {**base, "n_layer": n_layer, "mode": "nvme", "nvme": nvme}
        pair = run_pair(worker, {"name": f"verify {n_layer} layers", "runs": [spec]}, timeout=3600)
    ranks = [runs_of_rank[0] for runs_of_rank in pair]
    n = ranks[0]["parameters"]
    peak = max(r["peak_rss"] for r in ranks)
    predicted = fit_nvme["rss_fixed_bytes"] + fit_nvme["rss_bytes_per_param_per_rank"] * n
    row = {"n_layer": n_layer, "parameters": n, "peak_rss_per_rank": peak, "predicted_peak_rss": predicted}
    results["verify"] = row
    path.write_text(json.dumps(results, indent=2))
    print(
        f"nvme {n / 1e6:.0f}M parameters: peak RSS {peak / GIB:.2f} GiB per rank, the fit predicted "
        f"{predicted / GIB:.2f} GiB; losses {ranks[0]['losses']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--verify-layers",
        type=int,
        default=None,
        help="only train the NVMe mode at this many layers and compare its peak RSS with the prediction "
        "of the fit in the JSON of a previous full run",
    )
    args = parser.parse_args()
    if args.verify_layers is not None:
        verify(
            args.verify_layers, QUICK if args.quick else FULL, Path(args.json or "bench/results/largest.json")
        )
        return
    base = QUICK if args.quick else FULL
    out_path = Path(args.json or f"bench/results/largest{'_quick' if args.quick else ''}.json")
    ram = psutil.virtual_memory().total
    runs: dict[str, list[dict[str, Any]]] = {"in memory": [], "nvme": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("ZEROSHARD_BENCH_NVME")) as nvme:
        free_disk = shutil.disk_usage(nvme).free
        for mode, label in (("memory", "in memory"), ("nvme", "nvme")):
            for n_layer in base["sizes"]:
                spec = {**base, "n_layer": n_layer, "mode": mode, "nvme": nvme}
                pair = run_pair(worker, {"name": f"{label} {n_layer} layers", "runs": [spec]}, timeout=1800)
                ranks = [runs_of_rank[0] for runs_of_rank in pair]
                row = {
                    "n_layer": n_layer,
                    "parameters": ranks[0]["parameters"],
                    "peak_rss_per_rank": max(r["peak_rss"] for r in ranks),
                    "nvme_bytes_per_rank": max(r["nvme_bytes"] for r in ranks),
                    "losses": ranks[0]["losses"],
                }
                runs[label].append(row)
                peak, on_disk = row["peak_rss_per_rank"] / GIB, row["nvme_bytes_per_rank"] / GIB
                millions = row["parameters"] / 1e6
                print(
                    f"{label:9} {millions:7.1f}M parameters: peak RSS {peak:.2f} GiB per rank, "
                    f"NVMe {on_disk:.2f} GiB per rank",
                    flush=True,
                )
    budget = ram - SYSTEM_RESERVE
    summary: dict[str, Any] = {"ram_bytes": ram, "ram_budget_bytes": budget, "free_disk_bytes": free_disk}
    for label, rows in runs.items():
        fixed, per = fit([(r["parameters"], r["peak_rss_per_rank"]) for r in rows])
        by_ram = (budget / 2 - fixed) / per
        entry = {"rss_fixed_bytes": fixed, "rss_bytes_per_param_per_rank": per, "largest_by_ram": by_ram}
        if label == "nvme":
            _, disk_per = fit([(r["parameters"], r["nvme_bytes_per_rank"]) for r in rows])
            entry["nvme_bytes_per_param_per_rank"] = disk_per
            entry["largest_by_disk"] = free_disk / (2 * disk_per)
            entry["largest"] = min(by_ram, entry["largest_by_disk"])
        else:
            entry["largest"] = by_ram
        summary[label] = entry
    ratio_ram = summary["nvme"]["largest_by_ram"] / summary["in memory"]["largest"]
    ratio = summary["nvme"]["largest"] / summary["in memory"]["largest"]
    summary["ratio_ram_bound"] = ratio_ram
    summary["ratio_on_this_machine"] = ratio
    print(
        "\n| mode | RSS per rank = fixed + per parameter | largest by RAM | largest by free disk | largest |"
    )
    print("|---|---|---|---|---|")
    for label in runs:
        e = summary[label]
        disk = f"{e['largest_by_disk'] / 1e9:.2f}B" if "largest_by_disk" in e else "-"
        fixed, per = e["rss_fixed_bytes"] / GIB, e["rss_bytes_per_param_per_rank"]
        print(
            f"| {label} | {fixed:.2f} GiB + {per:.2f} B x N | {e['largest_by_ram'] / 1e9:.2f}B | {disk} | "
            f"{e['largest'] / 1e9:.2f}B |"
        )
    print(
        f"\nRAM {ram / GIB:.1f} GiB ({budget / GIB:.1f} GiB usable), free disk {free_disk / 1e9:.0f} GB: "
        f"NVMe trains a {ratio:.1f}x larger GPT here ({ratio_ram:.1f}x if the disk were not the limit)"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"config": base, "runs": runs, "summary": summary}, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
