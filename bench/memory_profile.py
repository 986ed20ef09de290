"""Where a rank's memory goes, phase by phase: the large GPT at one ZeRO stage (or DDP), RSS beside the
library's and the allocator's own accounting.

    .venv/bin/python bench/memory_profile.py --stage 3 --lean      # stage 3, -lean settings of bench/peers.py
    .venv/bin/python bench/memory_profile.py --stage 2 --glibc-defaults
    .venv/bin/python bench/memory_profile.py --stage ddp --quick   # tiny model: a smoke test

``WORLD_SIZE`` ranks (``ZEROSHARD_BENCH_WORLD_SIZE``) train the large GPT of ``bench/peers.py`` (same data and
settings) for a few steps. After each phase of each step (forward, backward, step) rank 0 records, above the
RSS before the model was built: the RSS, the peak RSS *within* the phase (``VmHWM``, reset after every phase
through ``/proc/self/clear_refs``), and glibc's own accounting (``mallinfo2``: bytes in use in its heaps,
free bytes it keeps in them, bytes in ``mmap``-ed blocks). At the end: ``engine.memory_breakdown()`` (model
state, gradient buckets, pooled idle buffers) and the buffer pool's high-water mark and misses (fresh
allocations; none per step once the pool is warm). ``--glibc-defaults`` leaves ``MALLOC_MMAP_THRESHOLD_``
unset (glibc's dynamic threshold keeps freed blocks below 32 MiB in its heap); ``--trim`` calls
``malloc_trim(0)`` after every step, to measure what that would return. Prints a table, writes
``bench/results/memory_profile_<stage>[_lean][_glibc][_trim]_w<W>.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

if "--glibc-defaults" in sys.argv:  # before common sets the threshold (and before torch is imported)
    os.environ["ZEROSHARD_BENCH_GLIBC_DEFAULTS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CLIP, LR, ROOT, WEIGHT_DECAY, WORLD_SIZE, build_gpt, ds_config, rss, run_pair, tokens_for

# isort: split
import torch

MIB = 2**20
RESULTS = ROOT / "bench" / "results"
LARGE = {"vocab_size": 16384, "block_size": 128, "n_layer": 12, "n_head": 16, "n_embd": 1024}  # peers.py's
QUICK = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _libc() -> Any:
    """glibc, or None (another C library: its figures are left out)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """One rank: build, train ``steps`` steps, record each phase. Collective: every rank runs it."""
    import zeroshard

    libc = _libc()
    model_cfg = run["model"]
    baseline = rss()
    model = build_gpt(model_cfg)
    phases: list[dict[str, Any]] = []
    engine: Any = None

    def mark(name: str) -> None:
        s = _status()
        row = {"phase": name, "rss": s["VmRSS"] - baseline, "peak": s["VmHWM"] - baseline}
        if libc is not None:
            info = libc.mallinfo2()
            row.update(heap_in_use=info.uordblks, heap_free=info.fordblks, mmapped=info.hblkhd)
        if engine is not None:
            row["pool_misses"] = engine.reducer.pool.misses
        phases.append(row)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the next phase's peak starts from here

    mark("model built")
    if run["stage"] == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        forward: Any = DDP(model, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    else:
        zero: dict[str, Any] = {"stage": int(run["stage"])}
        if run["lean"]:
            zero.update(
                stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=int(0.9 * model_cfg["n_embd"] ** 2)
            )
        config = ds_config(zero, 1)
        engine, _, _, _ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    mark("initialize")
    tokens = tokens_for(rank, run["steps"], 1, model_cfg, 32 if model_cfg == LARGE else None)
    for i in range(run["steps"]):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        if engine is None:
            loss = forward(x, y)
            mark(f"{i} forward")
            loss.backward()
            mark(f"{i} backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        else:
            loss = engine(x, y)
            mark(f"{i} forward")
            engine.backward(loss)
            mark(f"{i} backward")
            engine.step()
        if run["trim"] and libc is not None:
            libc.malloc_trim(0)
        mark(f"{i} step")
    out: dict[str, Any] = {"phases": phases, "glibc": libc is not None}
    if engine is not None:
        b = engine.memory_breakdown()
        pool = engine.reducer.pool
        out["breakdown"] = {
            k: getattr(b, k)
            for k in ("parameters", "gradients", "optimizer_state", "communication_buffers", "cached_buffers")
        }
        out["breakdown"].update(total=b.total, predicted=b.predicted.total)
        out["pool"] = {"high_water": pool.high_water_bytes, "spare": pool.spare_bytes, "misses": pool.misses}
        engine.destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["ddp", "0", "1", "2", "3"], required=True)
    parser.add_argument("--lean", action="store_true", help="stage 3 with bench/peers.py's -lean settings")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--glibc-defaults", action="store_true", help="leave MALLOC_MMAP_THRESHOLD_ unset")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) after every step")
    parser.add_argument("--quick", action="store_true", help="tiny model (a smoke test)")
    parser.add_argument("--out", type=Path, help="JSON output (default under bench/results/)")
    args = parser.parse_args()
    run = {
        "stage": args.stage,
        "lean": args.lean,
        "steps": args.steps,
        "trim": args.trim,
        "model": QUICK if args.quick else LARGE,
    }
    per_rank = run_pair(worker, {"name": "memory_profile", "runs": [run]}, timeout=1800)
    r0 = per_rank[0][0]
    print(f"stage {args.stage}{' lean' if args.lean else ''}, W={WORLD_SIZE}, rank 0, MiB above the baseline")
    print("| phase | RSS | peak within | glibc heap in use | glibc heap free | mmapped | pool misses |")
    print("|---|---|---|---|---|---|---|")
    for p in r0["phases"]:
        cells = [p["rss"], p["peak"], p.get("heap_in_use", 0), p.get("heap_free", 0), p.get("mmapped", 0)]
        print(
            f"| {p['phase']} | "
            + " | ".join(f"{c / MIB:.0f}" for c in cells)
            + f" | {p.get('pool_misses', '')} |"
        )
    if "breakdown" in r0:
        print("memory_breakdown (MiB):", {k: round(v / MIB, 1) for k, v in r0["breakdown"].items()})
        print("pool:", {k: (round(v / MIB, 1) if k != "misses" else v) for k, v in r0["pool"].items()})
    suffix = f"{args.stage}{'_lean' if args.lean else ''}{'_glibc' if args.glibc_defaults else ''}"
    suffix += f"{'_trim' if args.trim else ''}_w{WORLD_SIZE}{'_quick' if args.quick else ''}"
    out = args.out or RESULTS / f"memory_profile_{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS")}
    out.write_text(
        json.dumps({"run": run, "world_size": WORLD_SIZE, "env": env, "per_rank": per_rank}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
