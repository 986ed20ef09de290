"""Summaries, tables and plots of bench/results/peers.json: the peers tables of docs/benchmarks.md and its
plots docs/bench_*.png (``tools/benchmarks_page.py`` places the tables)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
# The plots' bar groups, in this order; a family appears where the results have a row of it.
FAMILIES = [
    "torch",
    "zeroshard",
    "zeroshard NVMe offload",
    "deepspeed",
    "deepspeed CPU offload",
    "deepspeed NVMe offload",
]
COLUMNS = (
    "| system | stage | median step (s) | min / max (s) | step × DDP (per round) | peak RSS / rank (MiB) "
    "| RSS × DDP | model state / rank (MiB) | state × DDP | ZeRO formula, in memory (MiB) "
    "| comm / step (MiB) | max \\|Δloss\\| |"
)


def summarise(size: dict[str, Any]) -> dict[str, Any]:
    """Per system of one size's results: pooled step times, in-round ratios to DDP (median over rounds),
    memory, comm, loss; a system of ``did_not_run`` gets a row that says why.

    ``size`` is a size's entry of peers.json: ``raw`` (per round, per system, per rank, what the worker
    returned), ``reference_losses``, ``did_not_run`` and ``systems`` (``peers.System.describe()`` of each).
    """
    rounds, ref, not_run = size["raw"], size["reference_losses"], size["did_not_run"]
    n = rounds[0]["ddp"][0]["num_parameters"]
    out: dict[str, Any] = {}
    for name, system in size["systems"].items():
        row: dict[str, Any] = {k: system[k] for k in ("stage", "family", "offload")}
        row["zero_formula_bytes"] = system["in_memory_bytes_per_param"] * n
        if name in not_run:
            out[name] = {**row, "did_not_run": not_run[name]}
            continue
        steps: list[float] = []
        ratios: list[float] = []
        for rnd in rounds:
            per_step = [max(ts) for ts in zip(*(r["times"] for r in rnd[name]), strict=True)]
            base = [max(ts) for ts in zip(*(r["times"] for r in rnd["ddp"]), strict=True)]
            steps += per_step
            ratios.append(statistics.median(per_step) / statistics.median(base))

        def peak(s: str) -> int:
            return max(r["peak_rss_above_baseline_bytes"] for rnd in rounds for r in rnd[s])

        def state(s: str) -> int:
            return max(r["model_state_bytes"] for rnd in rounds for r in rnd[s])

        loss_err = max(
            abs(statistics.fmean(ls) - ref[i])
            for rnd in rounds
            for i, ls in enumerate(zip(*(r["losses"] for r in rnd[name]), strict=True))
        )
        last = rounds[-1][name][0]
        measured = last["comm_bytes_per_step_measured"]
        out[name] = {
            **row,
            "median_s": statistics.median(steps),
            "min_s": min(steps),
            "max_s": max(steps),
            "step_ratio_to_ddp": statistics.median(ratios),
            "step_ratio_to_ddp_per_round": ratios,
            "peak_rss_above_baseline_bytes": peak(name),
            "peak_rss_ratio_to_ddp": peak(name) / peak("ddp"),
            "model_state_bytes": state(name),
            "model_state_ratio_to_ddp": state(name) / state("ddp"),
            "offloaded_bytes": last.get("offloaded_bytes"),
            "comm_bytes_per_step": measured if measured is not None else 4 * n * system["comm_4n"],
            "comm_source": "measured" if measured is not None else "formula",
            "max_abs_loss_diff": loss_err,
        }
    return out


def family(name: str, row: dict[str, Any]) -> str:
    """The row's plot family (results written before offload rows existed carry none: torch or runner)."""
    return row.get("family") or next((f for f in ("zeroshard", "deepspeed") if name.startswith(f)), "torch")


def _state(s: dict[str, Any]) -> str:
    text = f"{s['model_state_bytes'] / MIB:.1f}"
    if s.get("offloaded_bytes"):
        text += f" (+{s['offloaded_bytes'] / MIB:.1f} on NVMe)"
    return text


def table(size: dict[str, Any]) -> str:
    """The size's summary as a Markdown table; a system that did not run gets a row saying why."""
    lines = [COLUMNS, "|" + "---|" * COLUMNS.count(" | ") + "---|"]
    for name, s in size["summary"].items():
        if "did_not_run" in s:
            why = s["did_not_run"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {name} | {s['stage']} | did not run: {why} |" + " – |" * 9)
            continue
        per_round = ", ".join(f"{r:.2f}" for r in s["step_ratio_to_ddp_per_round"])
        lines.append(
            f"| {name} | {s['stage']} | {s['median_s']:.3f} | {s['min_s']:.3f} / {s['max_s']:.3f} "
            f"| **{s['step_ratio_to_ddp']:.2f}** ({per_round}) "
            f"| {s['peak_rss_above_baseline_bytes'] / MIB:.0f} | {s['peak_rss_ratio_to_ddp']:.2f} "
            f"| {_state(s)} | {s['model_state_ratio_to_ddp']:.2f} | {s['zero_formula_bytes'] / MIB:.1f} "
            f"| {s['comm_bytes_per_step'] / MIB:.1f} ({s['comm_source']}) | {s['max_abs_loss_diff']:.2e} |"
        )
    return "\n".join(lines)


def _plot(ax: Any, summ: dict[str, Any], what: str) -> None:
    """One figure's bars: per stage, one bar per system of that stage side by side, coloured by family;
    a system that did not run gets a label where its bar would be."""
    by_stage = {st: [(s, r) for s, r in summ.items() if r["stage"] == st] for st in range(4)}
    width = 0.84 / max(len(rows) for rows in by_stage.values())
    labelled: set[str] = set()
    for st, rows in by_stage.items():
        rows.sort(key=lambda sr: FAMILIES.index(family(*sr)) if family(*sr) in FAMILIES else len(FAMILIES))
        for j, (name, r) in enumerate(rows):
            x = st + (j - (len(rows) - 1) / 2) * width
            fam = family(name, r)
            if "did_not_run" in r:
                ax.text(x, 0, f" {name}: did not run", rotation=90, ha="center", va="bottom", fontsize=7)
                continue
            y = r["peak_rss_above_baseline_bytes"] / MIB if what == "memory" else r["step_ratio_to_ddp"]
            color = f"C{FAMILIES.index(fam)}" if fam in FAMILIES else "grey"
            ax.bar(x, y, width, color=color, label=None if fam in labelled else fam)
            labelled.add(fam)


def plots(doc: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for size_name, size in doc["sizes"].items():
        summ = size["summary"]
        for what in ("memory", "step_time"):
            fig, ax = plt.subplots(figsize=(8, 4.5))
            _plot(ax, summ, what)
            if what == "memory":
                # In-memory stages only: the offload rows' formula is lower and given in the table.
                stages = sorted({r["stage"] for r in summ.values() if not r.get("offload")})
                formula = [
                    next(r for r in summ.values() if r["stage"] == st and not r.get("offload"))
                    for st in stages
                ]
                ax.hlines(
                    [r["zero_formula_bytes"] / MIB for r in formula],
                    [st - 0.45 for st in stages],
                    [st + 0.45 for st in stages],
                    colors="k",
                    lw=2,
                    label="ZeRO formula (model state, in memory)",
                )
                ax.set_ylabel("peak RSS above baseline per rank (MiB)")
            else:
                ax.axhline(1.0, color="k", lw=0.8)
                ax.set_ylabel("median step time × DDP")
            ax.set_xticks(range(4), [f"stage {i}" for i in range(4)])
            ax.set_title(f"{size_name}: {size['num_parameters'] / 1e6:.1f}M parameters, W=2 gloo CPU")
            ax.legend(fontsize=7, loc="upper left", framealpha=0.9, ncol=2)
            ax.set_ylim(top=ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
            fig.tight_layout()
            name = f"bench_{size_name}_{what}.png"
            fig.savefig(ROOT / "docs" / name, dpi=90)
            plt.close(fig)
            names.append(name)
    return names


def _ops_line(doc: dict[str, Any]) -> list[str]:
    """What happened to the DeepSpeed ops the offload rows need (``peers.py``'s probe), as one line."""
    ops = doc.get("deepspeed_ops")
    if not ops:
        return []
    said = []
    for op in ("cpu_adam", "async_io"):
        o = ops[op]
        if o["ok"]:
            how = "built on first use" if o.get("built") else "loaded from the torch extensions cache"
        else:
            how = f"does not load ({o['reason']})"
        said.append(f"`{op}` {how}, {o.get('seconds', 0.0):.0f} s")
    return [f"DeepSpeed {ops.get('deepspeed', '')} ops for the offload rows: {'; '.join(said)}.", ""]


def section(doc: dict[str, Any]) -> str:
    """The peers tables of docs/benchmarks.md (``tools/benchmarks_page.py`` places them): the machine, what
    happened to DeepSpeed's ops, then per size its run, its table and its two plots."""
    m = doc["machine"]
    ds = f"; DeepSpeed from `{m['deepspeed_python']}`" if m.get("deepspeed_python") else ""
    parts = [
        f"Measured on: {m['cpus']} CPUs, Python {m['python']}, torch {m['torch']}, {m['platform']}; env "
        f"{m['env']}{ds}.",
        "",
        *_ops_line(doc),
    ]
    for size_name, size in doc["sizes"].items():
        st = size["settings"]
        seq = st.get("seq_len", st["model"]["block_size"])
        parts += [
            f"### {size_name}: {size['num_parameters'] / 1e6:.1f}M parameters",
            "",
            f"Model {st['model']}, {st['micro_batch']} × {seq} tokens per rank per "
            f"step, {st['warmup']} warm-up + {st['steps']} timed steps, {st['rounds']} interleaved round(s); "
            f"{size['wall_s'] / 60:.1f} min; load average before "
            f"{', '.join(f'{x:.2f}' for x in size['loadavg_before'])}, after "
            f"{', '.join(f'{x:.2f}' for x in size['loadavg_after'])}.",
            "",
            table(size),
            "",
        ]
        parts += [
            f"![{p}]({p})" for p in (f"bench_{size_name}_memory.png", f"bench_{size_name}_step_time.png")
        ]
        parts.append("")
    return "\n".join(parts)


def write_docs(doc: dict[str, Any]) -> None:
    """Draws docs/bench_*.png from ``doc`` and rewrites docs/benchmarks.md's tables, the peers tables from
    ``doc`` (``tools/benchmarks_page.py``)."""
    pngs = plots(doc)
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmarks_page

    benchmarks_page.write({"peers.json": doc})
    print(f"wrote {benchmarks_page.PAGE.relative_to(ROOT)} and docs/{', docs/'.join(pngs)}")


if __name__ == "__main__":
    write_docs(
        json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "bench/results/peers.json").read_text())
    )
