"""Activation memory at ZeRO stage 3: peak per rank against sequence length, with and without checkpointing.

    .venv/bin/python bench/activation_memory.py            # the table below docs/benchmarks.md's section
    .venv/bin/python bench/activation_memory.py --quick    # tiny sizes: a smoke test

A GPT (``examples/train_gpt.py``, 8 blocks of width 512, vocab 8192, 30M parameters) trains at stage 3 on
``WORLD_SIZE`` ranks (gloo, fp32 AdamW) with the ``-lean`` stage-3 settings of ``bench/peers.py`` (units
released after their forward, one unit prefetched), 2 sequences per rank per step, at each sequence length,
with every transformer block wrapped in ``torch.utils.checkpoint`` (non-reentrant) or not. Per run, on the
last of 3 steps: the peak RSS above the RSS before the model was built (``VmHWM``, reset before the step
through ``/proc/self/clear_refs``), what the forward left resident for backward (RSS after the forward minus
before it: saved activations and any parameters kept gathered), and the library's own accounting, the most
gathered parameter bytes at once (``ParameterGatherer.peak_gathered_bytes``) and the model state
(``engine.memory_breakdown().total``). Writes ``bench/results/activation_memory.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import CLIP, LR, ROOT, WEIGHT_DECAY, WORLD_SIZE, build_gpt, peak_rss, rss, run_pair, tokens_for

# isort: split
import torch
from torch.utils.checkpoint import checkpoint

MIB = 2**20
RESULTS = ROOT / "bench" / "results"

SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "model": {"vocab_size": 8192, "block_size": 2048, "n_layer": 8, "n_head": 8, "n_embd": 512},
        "micro_batch": 2,
        "seq_lens": [256, 512, 1024, 2048],
    },
    "quick": {
        "model": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "seq_lens": [32, 64],
        "zero": {"stage3_param_persistence_threshold": 0},  # units this small would all stay whole
    },
}
STEPS = 3


def reset_peak() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux ``clear_refs``); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Run every transformer block of ``model`` under non-reentrant ``torch.utils.checkpoint``."""
    for block in model.blocks:  # type: ignore[union-attr]
        forward = block.forward

        def run(x: torch.Tensor, forward: Any = forward) -> torch.Tensor:
            return checkpoint(forward, x, use_reentrant=False)

        block.forward = run


def worker(rank: int, run: dict[str, Any]) -> dict[str, Any]:
    """One (sequence length, checkpointing) case on one rank. Collective: every rank runs it."""
    import zeroshard

    model_cfg = run["model"]
    baseline = rss()
    model = build_gpt(model_cfg)
    if run["checkpointing"]:
        checkpoint_blocks(model)
    zero = {"stage": 3, "stage3_max_reuse_distance": 0}
    zero["stage3_prefetch_bucket_size"] = int(0.9 * model_cfg["n_embd"] ** 2)
    zero.update(run["zero"])
    config = {
        "train_micro_batch_size_per_gpu": run["micro_batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = tokens_for(rank, STEPS, run["micro_batch"], model_cfg, run["seq_len"])
    held = 0
    reset = False
    for i in range(STEPS):
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        last = i == STEPS - 1
        if last:
            reset = reset_peak()
        before = rss()
        loss = engine(x, y)
        if last:
            held = rss() - before
        engine.backward(loss)
        engine.step()
    peak = peak_rss() - baseline
    result = {
        "seq_len": run["seq_len"],
        "checkpointing": run["checkpointing"],
        "peak_rss_above_baseline_bytes": peak,
        "peak_is_last_step": reset,
        "held_after_forward_bytes": held,
        "peak_gathered_bytes": engine.gatherer.peak_gathered_bytes,
        "model_state_bytes": engine.memory_breakdown().total,
        "loss": float(loss.item()),
    }
    engine.destroy()
    return result


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| sequence length | checkpointing | peak RSS above baseline (MiB) | held after forward (MiB) | "
        "most parameters gathered at once (MiB) | model state (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq_len']} | {'yes' if r['checkpointing'] else 'no'} | "
            f"{r['peak_rss_above_baseline_bytes'] / MIB:.0f} | {r['held_after_forward_bytes'] / MIB:.0f} | "
            f"{r['peak_gathered_bytes'] / MIB:.1f} | {r['model_state_bytes'] / MIB:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/activation_memory.json)")
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    runs = [
        {
            "model": size["model"],
            "micro_batch": size["micro_batch"],
            "zero": size.get("zero", {}),
            "seq_len": t,
            "checkpointing": c,
        }
        for t in size["seq_lens"]
        for c in (False, True)
    ]
    started = time.time()
    # A fresh process pair per case: a previous case's memory (freed when the garbage collector gets to its
    # engine) cannot move this one's baseline.
    per_rank = [
        [r[0] for r in run_pair(worker, {"name": "activation_memory", "runs": [run]})] for run in runs
    ]
    # Per case, the rank with the larger peak.
    rows = [max(ranks, key=lambda x: x["peak_rss_above_baseline_bytes"]) for ranks in per_rank]
    doc = {
        "settings": {**size, "world_size": WORLD_SIZE, "steps": STEPS, "stage": 3},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
        "torch": torch.__version__,
        "rows": rows,
        "cases": per_rank,  # per case, every rank's result
    }
    out = args.out or RESULTS / ("activation_memory_quick.json" if args.quick else "activation_memory.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(table(rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
