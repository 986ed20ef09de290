"""The memory tables of docs/benchmarks.md ("Memory by ZeRO stage"), rendered from committed
``bench/results/*.json``: peers at W = 2 and 4, ``zeroshard estimate`` against ``memory_breakdown()``, and
``bench/memory_profile.py``'s phases. Same contract as ``tools/benchmark_tables.py``.
"""

from __future__ import annotations

from typing import Any

from benchmark_tables import MIB, Load, machine_line, span

# What each zeroshard stage is meant to reach, as peak RSS per rank × DDP's, on the large GPT.
TARGETS = {
    "zeroshard-stage1": 0.80,
    "zeroshard-stage2": 0.70,
    "zeroshard-stage3": 0.55,
    "zeroshard-stage3-lean": 0.55,
}


def _ratio(x: float, target: float | None) -> str:
    """Two decimals, three where two would round onto the target."""
    text = f"{x:.2f}"
    return f"{x:.3f}" if target is not None and float(text) == target else text


def memory_by_stage(load: Load) -> str:
    w2, w4 = load("peers.json")["sizes"]["large"], load("peers_large_w4.json")["sizes"]["large"]
    lines = [
        "| system | stage | target × DDP | W = 2: peak RSS (MiB) | × DDP | W = 4: peak RSS (MiB) | × DDP "
        "| W = 4: model state (MiB) | W = 2 / W = 4: step × DDP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in w2["summary"].items():
        b = w4["summary"].get(name)
        if b is None or "did_not_run" in a or "did_not_run" in b:
            continue
        target = TARGETS.get(name)
        lines.append(
            f"| {name} | {a['stage']} | {'' if target is None else f'≤ {target:.2f}'} "
            f"| {a['peak_rss_above_baseline_bytes'] / MIB:.0f} "
            f"| {_ratio(a['peak_rss_ratio_to_ddp'], target)} "
            f"| {b['peak_rss_above_baseline_bytes'] / MIB:.0f} "
            f"| {_ratio(b['peak_rss_ratio_to_ddp'], target)} "
            f"| {b['model_state_bytes'] / MIB:.0f} "
            f"| {a['step_ratio_to_ddp']:.2f} / {b['step_ratio_to_ddp']:.2f} |"
        )
    runs = (
        f"W = 2: {w2['wall_s'] / 60:.1f} min, W = 4: {w4['wall_s'] / 60:.1f} min; "
        f"{w2['settings']['warmup']} warm-up and {w2['settings']['steps']} timed steps."
    )
    return "\n\n".join([machine_line(load("peers.json")["machine"]) + " " + runs, "\n".join(lines)])


def _estimate_rows(doc: dict[str, Any]) -> tuple[str, list[str]]:
    """bench/estimate_check.py's rows for one peers results file: (DDP's note, table rows)."""
    from zeroshard.estimate import estimate_memory

    size = doc["sizes"]["large"]
    w, raw = size["settings"]["world_size"], size["raw"][0]
    model = size["settings"]["model"]
    est = estimate_memory(
        raw["ddp"][0]["num_parameters"],
        gpus_per_node=w,
        dtype="fp32",
        largest_layer=int(model["vocab_size"] * model["n_embd"]),
    )
    ddp = max(r["rss_after_steps_above_baseline_bytes"] - r["model_state_bytes"] for r in raw["ddp"])
    rows = []
    for name, per_rank in raw.items():
        if not name.startswith("zeroshard-stage") or "nvme" in name:
            continue
        r = max(per_rank, key=lambda x: x["model_state_bytes"])
        e = est.row(size["systems"][name]["stage"]).per_gpu
        state = r["model_state_bytes"]
        resident = r["rss_after_steps_above_baseline_bytes"] - (r["cached_buffer_bytes"] or 0)
        buckets = r["communication_buffer_bytes"] + (r.get("dropped_gradient_bytes") or 0)
        rows.append(
            f"| {w} | {name} | {e / MIB:.0f} | {state / MIB:.0f} | {abs(state / e - 1) * 100:.1f} % "
            f"| {(state - buckets) / MIB:.0f} | {resident / MIB:.0f} "
            f"| {(resident - state + buckets) / MIB:+.0f} |"
        )
    return f"W = {w}: DDP's RSS after its steps is its model state + {ddp / MIB:.0f} MiB.", rows


def estimate_check(load: Load) -> str:
    lines = [
        "| W | system | estimate (MiB) | memory_breakdown().total (MiB) | within | kept between steps (MiB) "
        "| RSS after the steps less pooled idle buffers (MiB) | framework's own (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name in ("peers.json", "peers_large_w4.json"):
        note, rows = _estimate_rows(load(name))
        notes.append(note)
        lines += rows
    return "\n\n".join(["\n".join(lines), " ".join(notes)])


def _phases(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rank 0's phases of a bench/memory_profile.py run, by name ("1 backward", "3 step", ...)."""
    return {p["phase"]: p for p in doc["per_rank"][0][0]["phases"]}


def _profile_column(doc: dict[str, Any]) -> list[str]:
    """One zeroshard column of the profile table, rank 0, MiB: steps 1-3 (step 0 warms the pool up)."""
    r0 = doc["per_rank"][0][0]
    ph, b, pool = _phases(doc), r0["breakdown"], r0["pool"]
    steps = range(1, doc["run"]["steps"])
    peak = max(ph[f"{i} backward"]["peak"] for i in steps)
    formula = b["predicted"]
    kept = formula - b["gradients"]  # zero_grad drops the gradient shards
    last = doc["run"]["steps"] - 1  # breakdown and pool are read after the last step
    own = ph[f"{last} step"]["rss"] - kept - b["cached_buffers"]
    misses = (ph[f"{last} step"]["pool_misses"] - ph["0 step"]["pool_misses"]) / len(steps)
    return [
        f"{peak / MIB:.0f}",
        f"{formula / MIB:.0f}",
        f"{own / MIB:.0f}",
        f"{(peak - formula - own) / MIB:.0f}",
        f"{kept / MIB:.0f}",
        f"{pool['high_water'] / MIB:.0f} + {pool['spare'] / MIB:.0f}",
        f"{misses:.0f}",
    ]


PROFILE_ROWS = [
    "peak RSS above baseline",
    "= model state at the step (the formula)",
    "+ the framework's own (RSS after a step less the state kept between steps and idle pooled buffers)",
    "+ transient in backward: autograd's gradients, and the pool's buffers in use or idle, less the gradient "
    "shards not yet reduced",
    "model state kept between steps (the formula less the gradient shards, which `zero_grad` drops)",
    "pool high-water mark + spare",
    "pool misses (new buffers) per step, steps 1-3",
]


def memory_profile(load: Load) -> str:
    ddp = load("peers.json")["sizes"]["large"]
    d = ddp["summary"]["ddp"]
    own = max(
        r["rss_after_steps_above_baseline_bytes"] - r["model_state_bytes"] for r in ddp["raw"][0]["ddp"]
    )
    peak, formula = d["peak_rss_above_baseline_bytes"], d["zero_formula_bytes"]
    columns = [
        [f"{x / MIB:.0f}" for x in (peak, formula, own, peak - formula - own, formula)] + ["–", "–"],
        *(_profile_column(load(f"memory_profile_{name}_w2.json")) for name in ("2", "3_lean", "3")),
    ]
    lines = ["| | DDP | stage 2 | stage 3 `-lean` | stage 3 (defaults) |", "|---|---|---|---|---|"]
    for i, label in enumerate(PROFILE_ROWS):
        lines.append(f"| {label} | " + " | ".join(col[i] for col in columns) + " |")
    return "\n".join(lines)


ALLOCATORS = [
    ("2", "`MALLOC_MMAP_THRESHOLD_=65536`"),
    ("2_glibc", "glibc's defaults"),
    ("2_glibc_trim", "glibc's defaults, `malloc_trim(0)` after every step"),
]


def allocator(load: Load) -> str:
    lines = [
        "| allocator | peak RSS in backward | RSS between steps "
        "| free bytes glibc keeps in its heaps between steps |",
        "|---|---|---|---|",
    ]
    for name, label in ALLOCATORS:
        doc = load(f"memory_profile_{name}_w2.json")
        ph, steps = _phases(doc), range(1, doc["run"]["steps"])
        free = span([ph[f"{i} step"]["heap_free"] / MIB for i in steps])
        lines.append(
            f"| {label} | {span([ph[f'{i} backward']['peak'] / MIB for i in steps])} "
            f"| {span([ph[f'{i} step']['rss'] / MIB for i in steps])} "
            f"| {free}{' (pages returned to the system)' if doc['run']['trim'] else ''} |"
        )
    return "\n".join(lines)
