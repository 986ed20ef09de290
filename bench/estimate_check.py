"""`zeroshard estimate` and `engine.memory_breakdown()` against what bench/peers.py measured, per stage.

    .venv/bin/python bench/estimate_check.py bench/results/peers.json bench/results/peers_large_w4.json

For the large GPT of each results file (any world size): the estimate (``zeroshard.estimate.estimate_memory``,
fp32, with the largest layer, which stage 3 gathers), the model state ``engine.memory_breakdown().total``
measured from the tensors the engine holds (with the peak of the transient gradient buckets), and what is
resident after the last step: RSS above the pre-model baseline less the pooled idle buffers
(``cached_buffers``), beside the model state kept between steps (``total`` less the bucket peak and the
gradient shards that the step's ``zero_grad`` dropped, where the results record them). Their difference is
the framework's own memory (interpreter objects, gloo, code pages touched by ``initialize``), which DDP has
too: its RSS after its steps less its model state is printed below the table. "within" is
|breakdown / estimate - 1|.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zeroshard.estimate import estimate_memory

MIB = 2**20


def largest_layer(model: dict[str, Any]) -> int:
    """Parameters of the GPT's largest module: the token embedding (tied to the LM head)."""
    return int(model["vocab_size"] * model["n_embd"])


def rows(doc: dict[str, Any]) -> list[str]:
    size = doc["sizes"]["large"]
    w = size["settings"]["world_size"]
    raw = size["raw"][0]
    n = raw["ddp"][0]["num_parameters"]
    est = estimate_memory(
        n, gpus_per_node=w, dtype="fp32", largest_layer=largest_layer(size["settings"]["model"])
    )
    ddp = max(r["rss_after_steps_above_baseline_bytes"] - r["model_state_bytes"] for r in raw["ddp"])
    out = [f"W = {w}: DDP's RSS after its steps is its model state + {ddp / MIB:.0f} MiB."]
    for name, per_rank in raw.items():
        if not name.startswith("zeroshard-stage") or "nvme" in name:
            continue
        r = max(per_rank, key=lambda x: x["model_state_bytes"])
        stage = size["systems"][name]["stage"]
        e = est.row(stage).per_gpu
        state = r["model_state_bytes"]
        resident = r["rss_after_steps_above_baseline_bytes"] - (r["cached_buffer_bytes"] or 0)
        buckets = r.get("communication_buffer_bytes")  # absent from results written before it was recorded
        if buckets is not None:
            buckets += r.get("dropped_gradient_bytes") or 0  # not held between steps either
        kept = "–" if buckets is None else f"{(state - buckets) / MIB:.0f}"
        own = "–" if buckets is None else f"{(resident - state + buckets) / MIB:+.0f}"
        out.append(
            f"| {w} | {name} | {e / MIB:.0f} | {state / MIB:.0f} | {abs(state / e - 1) * 100:.1f} % | "
            f"{kept} | {resident / MIB:.0f} | {own} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench/peers.py JSON files with a large size")
    args = parser.parse_args()
    print(
        "| W | system | estimate (MiB) | memory_breakdown().total (MiB) | within | kept between steps (MiB) "
        "| RSS after the steps less pooled idle buffers (MiB) | framework's own (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for path in args.results:
        first, *table = rows(json.loads(path.read_text()))
        notes.append(first)
        print("\n".join(table))
    print()
    print(" ".join(notes))


if __name__ == "__main__":
    main()
