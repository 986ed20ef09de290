"""How long a checkpoint save blocks the training loop: synchronous against ``async_save=True``.

    .venv/bin/python bench/checkpoint_async.py           # the large GPT of bench/peers.py, W=2 (~2-3 min)
    .venv/bin/python bench/checkpoint_async.py --quick   # tiny GPT: a smoke test

Model: bench/peers.py's large GPT (12 layers, width 1024, vocab 16384, block 128), zeroshard stage 2, fp32
AdamW, 1 x 32 tokens per rank per step, W=2 gloo on this machine's CPUs; checkpoints go to a temporary
directory (/tmp, here the disk of the repository). After one synchronous save, ``async_saves`` asynchronous
ones, each followed by steps until its write ended and a ``wait_for_checkpoint``. Per rank:

* ``step``: the median of ``steps`` steps without a save in flight.
* ``sync save``: the time ``save_checkpoint`` blocks (write, fsync, publish).
* ``async stall`` (the headline): the time ``save_checkpoint(async_save=True)`` blocks in the steady state,
  the slowest of the second and later asynchronous saves, which copy into the host buffers the first one
  allocated ([Note: host snapshot buffers]); ``first async stall``: the first save, which allocates them
  and pays the page faults. ``copy``: the part of a stall spent copying into the buffers (the rest is the
  tag and token agreement, gathering the file entries and building metadata.json).
* ``step during write``: the median time of the steps run while a save's background write was in flight
  on some rank (a step that ends after the write finished counts), over every asynchronous save.
* ``write``: from the async call's return to the end of the background write (median over the saves);
  ``publish``: the ``wait_for_checkpoint`` that follows (metadata.json, renames, ``latest``; the slowest).

Each number is the slower rank's. Raw results: ``bench/results/checkpoint_async.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import ROOT, WORLD_SIZE, build_gpt, ds_config, rank_main, run_ranks, tokens_for

# isort: split
import torch

RESULTS = ROOT / "bench" / "results"

SIZES: dict[str, dict[str, Any]] = {
    # bench/peers.py's "large" GPT, fed as peers.py feeds it (1 x 32 tokens per rank per step).
    "large": {
        "model": {"vocab_size": 16384, "block_size": 128, "n_layer": 12, "n_head": 16, "n_embd": 1024},
        "micro_batch": 1,
        "seq_len": 32,
        "warmup": 2,
        "steps": 4,
        "during": 12,
        "async_saves": 3,
    },
    "quick": {
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "seq_len": 32,
        "warmup": 1,
        "steps": 3,
        "during": 3,
        "async_saves": 3,
    },
}


def _time_copies(copies: list[float]) -> None:
    """Add the seconds each host-buffer copy of this process takes to ``copies``."""
    from zeroshard.checkpoint.host_buffers import HostBuffers

    copy = HostBuffers.copy

    def timed(self: HostBuffers, tensors: Any) -> list[torch.Tensor]:
        start = time.perf_counter()
        try:
            return copy(self, tensors)
        finally:
            copies.append(time.perf_counter() - start)

    HostBuffers.copy = timed  # type: ignore[method-assign]


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, time steps, a synchronous save, then asynchronous saves and the steps during their
    writes.

    Collective: every rank runs it.
    """
    import zeroshard

    model = build_gpt(run["model"])
    engine, _, _, _ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config({"stage": 2}, run["micro_batch"])
    )
    n = run["warmup"] + run["steps"] + run["during"] * run["async_saves"] + 2
    tokens = tokens_for(rank, n, run["micro_batch"], run["model"], run["seq_len"])
    it = iter(range(n))

    def step() -> float:
        i = next(it)
        start = time.perf_counter()
        engine.backward(engine(tokens[i, :, :-1], tokens[i, :, 1:]))
        engine.step()
        return time.perf_counter() - start

    for _ in range(run["warmup"]):
        step()
    steps = [step() for _ in range(run["steps"])]
    root = Path(run["dir"])
    start = time.perf_counter()
    engine.save_checkpoint(str(root / "sync"), tag="t")
    sync_s = time.perf_counter() - start
    copies: list[float] = []
    _time_copies(copies)
    saves = [
        _async_save(engine, root, f"t{i}", step, run["during"], copies) for i in range(run["async_saves"])
    ]
    host = engine.__dict__["_checkpoint_writer"].host
    steady = saves[1:] or saves
    return {
        "step_s": statistics.median(steps),
        "sync_save_s": sync_s,
        "async_stall_s": max(s["stall_s"] for s in steady),
        "async_copy_s": max(s["copy_s"] for s in steady),
        "first_async_stall_s": saves[0]["stall_s"],
        "first_async_copy_s": saves[0]["copy_s"],
        "step_during_write_s": statistics.median(d for s in saves for d in s["during"])
        if any(s["during"] for s in saves)
        else float("nan"),
        "write_s": statistics.median(s["write_s"] for s in saves),
        "publish_s": max(s["publish_s"] for s in saves),
        "saves": saves,
        "host_buffer_bytes": host.shard.nbytes + host.extra.nbytes,
        "host_buffer_allocations": host.shard.allocations + host.extra.allocations,
        "shard_bytes": sum(
            f.stat().st_size for f in (root / "async" / "t0").iterdir() if f.name.startswith("shard")
        ),
        "rank": rank,
    }


def _async_save(
    engine: Any, root: Path, tag: str, step: Any, max_steps: int, copies: list[float]
) -> dict[str, Any]:
    """One asynchronous save: its stall, then steps until every rank's write ended, then the publish."""
    engine.comm.barrier()
    copies.clear()
    start = time.perf_counter()
    engine.save_checkpoint(str(root / "async"), tag=tag, async_save=True)
    stall_s = time.perf_counter() - start
    pending = engine.__dict__["_checkpoint_writer"].pending.result  # the background write's future
    returned = time.perf_counter()
    ended: list[float] = []
    pending.add_done_callback(lambda _: ended.append(time.perf_counter()))
    during: list[float] = []
    # Steps until every rank's write ended (the ranks agree when to stop, outside the timed step).
    while len(during) < max_steps and not all(engine.comm.all_gather_object(pending.done())):
        during.append(step())
    pending.result()
    write_s = ended[0] - returned
    start = time.perf_counter()
    engine.wait_for_checkpoint()
    publish_s = time.perf_counter() - start
    return {
        "stall_s": stall_s,
        "copy_s": sum(copies),
        "during": during,
        "write_s": write_s,
        "publish_s": publish_s,
    }


def summarise(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    slow = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k.endswith("_s")}
    return {
        **slow,
        "stall_ratio": slow["async_stall_s"] / slow["sync_save_s"],
        "first_stall_ratio": slow["first_async_stall_s"] / slow["sync_save_s"],
        "step_ratio": slow["step_during_write_s"] / slow["step_s"],
        "checkpoint_bytes": per_rank[0]["shard_bytes"],
        "host_buffer_bytes": max(r["host_buffer_bytes"] for r in per_rank),
    }


def table(summary: dict[str, Any]) -> str:
    rows = [
        ("step (no save in flight)", summary["step_s"], ""),
        ("sync save: blocked", summary["sync_save_s"], "1.00 x sync save"),
        (
            "async save: blocked (steady state)",
            summary["async_stall_s"],
            f"{summary['stall_ratio']:.3f} x sync save",
        ),
        ("  of which copy to host buffers", summary["async_copy_s"], ""),
        (
            "first async save: blocked",
            summary["first_async_stall_s"],
            f"{summary['first_stall_ratio']:.3f} x sync save",
        ),
        ("  of which copy to host buffers", summary["first_async_copy_s"], ""),
        (
            "step during the background write",
            summary["step_during_write_s"],
            f"{summary['step_ratio']:.2f} x step",
        ),
        ("background write (after the call)", summary["write_s"], ""),
        ("wait_for_checkpoint (publish)", summary["publish_s"], ""),
    ]
    lines = [f"| {'what':36} | {'seconds':>8} | {'ratio':22} |", f"|{'-' * 38}|{'-' * 10}|{'-' * 24}|"]
    lines += [f"| {w:36} | {s:8.3f} | {r:22} |" for w, s, r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny GPT (smoke test)")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/checkpoint_async.json)")
    parser.add_argument("--rank", nargs=3, metavar=("RANK", "SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:  # one rank of a run (common.run_ranks)
        rank_main(worker, int(args.rank[0]), args.rank[1], args.rank[2])
        return
    size = "quick" if args.quick else "large"
    out_path = args.out or RESULTS / (
        "checkpoint_async_quick.json" if args.quick else "checkpoint_async.json"
    )
    tmp = tempfile.mkdtemp(prefix="ckpt-async-")
    try:
        spec = {"name": f"checkpoint_async {size}", "runs": [{**SIZES[size], "dir": tmp}]}
        per_rank = [r[0] for r in run_ranks(sys.executable, str(Path(__file__).resolve()), spec, timeout=600)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = summarise(per_rank)
    print(table(summary))
    doc = {
        "command": "bench/checkpoint_async.py" + (" --quick" if args.quick else ""),
        "date": datetime.date.today().isoformat(),
        "world_size": WORLD_SIZE,
        "size": size,
        "settings": SIZES[size],
        "torch": torch.__version__,
        "summary": summary,
        "ranks": per_rank,
    }
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
