"""The figure tables of docs/benchmarks.md, each rendered from committed ``bench/results/*.json``.

Every renderer takes ``load`` (a results file name under ``bench/results/`` -> its parsed JSON) and returns
the Markdown between one pair of generated markers: the machine the figures were measured on (as far as the
JSON records it), then the table. Nothing here runs a benchmark; ``tools/benchmarks_page.py`` places the text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Load = Callable[[str], Any]
MIB = 2**20
GIB = 2**30


def machine_line(m: dict[str, Any] | None, torch: str | None = None) -> str:
    """The "Measured on: ..." line from a results file's ``machine`` block (or only its torch version)."""
    m = m or {}
    parts = []
    if m.get("cpus"):
        parts.append(f"{m['cpus']} CPUs")
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB RAM")
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    if m.get("torch") or torch:
        parts.append(f"torch {m.get('torch') or torch}")
    if m.get("platform"):
        parts.append(m["platform"])
    return f"Measured on: {', '.join(parts)}." if parts else ""


def _join(*pieces: str) -> str:
    return "\n\n".join(p for p in pieces if p)


def _exp(x: float) -> str:
    """``1.7e-7`` (no zero-padded exponent); ``0`` for zero."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def span(values: list[float], fmt: str = ".0f") -> str:
    """``a-b`` over values that differ after formatting, else the one value."""
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return lo if lo == hi else f"{lo}-{hi}"


def step_time(load: Load) -> str:
    doc = load("step_time.json")
    m = doc["machine"]
    run = (
        f"{doc['settings']['rounds']} rounds, {doc['wall_s'] / 60:.0f} min; load average "
        f"{m['loadavg_before'][0]:.1f} before and {m['loadavg_after'][0]:.1f} after."
    )
    return _join(machine_line(m) + " " + run, step_time_rows(doc["summary"]))


def step_time_rows(summaries: dict[str, dict[str, Any]]) -> str:
    """The step-time table of ``bench/step_time.py``'s summaries (model -> system -> figures)."""
    lines = [
        "| model | system | median step (ms) | min / max (ms) | × DDP (per round) | model state / rank (MiB) "
        "| collectives / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, summary in summaries.items():
        n = next(iter(summary.values()))["num_parameters"]
        label = f"{model} ({n / 1e3:.0f}k)" if n < 1e6 else f"{model} ({n / 1e6:.1f}M)"
        for name, s in summary.items():
            per_round = ", ".join(f"{r:.2f}" for r in s["ratio_to_ddp_per_round"])
            calls = s["comm_calls_per_step_by_op"]
            calls_text = ", ".join(f"{k} {v:g}" for k, v in sorted(calls.items())) if calls else ""
            lines.append(
                f"| {label} | {name} | {1e3 * s['median_s']:.1f} | {1e3 * s['min_s']:.1f} / "
                f"{1e3 * s['max_s']:.1f} | **{s['ratio_to_ddp']:.2f}** ({per_round}) "
                f"| {s['model_state_bytes'] / MIB:.1f} | {calls_text} |"
            )
    return "\n".join(lines)


def comm_ops(load: Load) -> str:
    doc = load("comm_ops.json")
    lines = [
        "| W | elements per shard | op | gloo collective (ms) | direct exchange (ms) | gloo / direct |",
        "|---|---|---|---|---|---|",
    ]
    keyed = {(r["world_size"], r["shard_elements"], r["op"], r["system"]): r["median_s"] for r in doc["rows"]}
    for w, n, op in sorted({(r["world_size"], r["shard_elements"], r["op"]) for r in doc["rows"]}):
        t, z = keyed[(w, n, op, "torch")], keyed[(w, n, op, "zeroshard")]
        lines.append(f"| {w} | {n:,} | {op} | {t * 1e3:.2f} | {z * 1e3:.2f} | {t / z:.2f} |")
    return _join(machine_line(doc["machine"]), "\n".join(lines))


def compile_table(load: Load) -> str:
    doc = load("compile.json")
    lines = [
        "| stage | eager (ms) | compiled (ms) | eager / compiled | graphs (unchanged after warm-up) |",
        "|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        stable = "yes" if r["graphs_stable"] else "no"
        lines.append(
            f"| {r['stage']} | {r['eager_s'] * 1e3:.1f} | {r['compiled_s'] * 1e3:.1f} | {r['speedup']:.2f} "
            f"| {r['graphs']} ({stable}) |"
        )
    backend = f"Backend `{doc['config']['backend']}`."
    return _join(machine_line(None, doc["torch"]) + " " + backend, "\n".join(lines))


def activation_memory(load: Load) -> str:
    doc = load("activation_memory.json")
    lines = [
        "| sequence length | checkpointing | peak RSS above baseline (MiB) | held after forward (MiB) "
        "| most parameters gathered at once (MiB) | model state (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['seq_len']} | {'yes' if r['checkpointing'] else 'no'} "
            f"| {r['peak_rss_above_baseline_bytes'] / MIB:.0f} | {r['held_after_forward_bytes'] / MIB:.0f} "
            f"| {r['peak_gathered_bytes'] / MIB:.0f} | {r['model_state_bytes'] / MIB:.0f} |"
        )
    run = f"{doc['wall_s'] / 60:.1f} min."
    return _join(machine_line(None, doc["torch"]) + " " + run, "\n".join(lines))


# The rows of bench/cpu_adam.py's results shown, in this order: (variant, threads, tensors, label, bold).
CPU_ADAM_ROWS = [
    ("torch-adamw-loop", 1, 200, "torch AdamW, for-loop (torch's CPU default)", False),
    ("torch-adamw-foreach", 1, 200, "torch AdamW, foreach", False),
    ("torch-adamw-fused", 1, 200, "torch AdamW, fused", True),
    ("zeroshard-DeepSpeedAdam", 1, 200, "zeroshard DeepSpeedAdam (only for `bias_correction: false`)", False),
    ("deepspeed-cpu-adam", 1, 200, "DeepSpeedCPUAdam", False),
    ("torch-adamw-fused", 2, 200, "torch AdamW, fused", False),
    ("deepspeed-cpu-adam", 2, 200, "DeepSpeedCPUAdam", False),
    ("torch-adamw-fused", 1, 1, "torch AdamW, fused", False),
    ("deepspeed-cpu-adam", 1, 1, "DeepSpeedCPUAdam", False),
]


def cpu_adam(load: Load) -> str:
    doc = load("cpu_adam.json")
    rows = {(r["variant"], r["threads"], r["tensors"]): r for r in doc["summary"]}
    lines = [
        "| variant | threads | tensors | Mparams/s | × DeepSpeedCPUAdam | max rel diff vs torch foreach |",
        "|---|---|---|---|---|---|",
    ]
    for variant, threads, tensors, label, bold in CPU_ADAM_ROWS:
        r = rows[(variant, threads, tensors)]
        if "error" in r:
            lines.append(f"| {label} | {threads} | {tensors} | not measured: {r['error']} | | |")
            continue
        b = "**" if bold else ""
        ratio = "n/a" if r["x_deepspeed"] is None else f"{b}{r['x_deepspeed']:.2f}{b}"
        lines.append(
            f"| {b}{label}{b} | {threads} | {tensors} | {b}{r['params_per_s'] / 1e6:.0f}{b} | {ratio} "
            f"| {_exp(r['max_rel_diff'])} |"
        )
    m = doc["machine"]
    ds = f"DeepSpeed {doc['deepspeed']['deepspeed']}; CPU capability {m['cpu_capability']}."
    return _join(machine_line(m) + " " + ds, "\n".join(lines))


NVME_DEFAULT = "threads=2 block=1024K qd=8"


def _nvme_label(config: str) -> str:
    """``threads=2 block=1024K qd=8`` -> ``store, 2 threads, 1 MiB × 8``."""
    fields = dict(part.split("=") for part in config.split())
    threads, block = int(fields["threads"]), int(fields["block"].rstrip("K")) // 1024
    label = f"store, {threads} thread{'s' if threads > 1 else ''}, {block} MiB × {fields['qd']}"
    if config == "threads=1 block=1024K qd=8":
        label += " (DeepSpeed's aio defaults)"
    return label


def nvme_io(load: Load) -> str:
    doc = load("nvme_io.json")
    ref = doc["raw_reference"]
    lines = [
        "| config | write GB/s | read GB/s | % raw write | % raw read |",
        "|---|---|---|---|---|",
    ]
    for bs, v in doc["raw"].items():
        lines.append(
            f"| raw, dd bs={bs} | {v['write'] / 1e9:.2f} | {v['read'] / 1e9:.2f} "
            f"| {100 * v['write'] / ref['write']:.0f} | {100 * v['read'] / ref['read']:.0f} |"
        )
    for row in doc["store"]:
        if row["config"] == NVME_DEFAULT:
            lines.append(
                f"| **{_nvme_label(row['config'])} (zeroshard's default)** | {row['write_Bps'] / 1e9:.2f} "
                f"| {row['read_Bps'] / 1e9:.2f} "
                f"| **{row['pct_raw_write']:.0f}** | **{row['pct_raw_read']:.0f}** |"
            )
            continue
        lines.append(
            f"| {_nvme_label(row['config'])} | {row['write_Bps'] / 1e9:.2f} | {row['read_Bps'] / 1e9:.2f} "
            f"| {row['pct_raw_write']:.0f} | {row['pct_raw_read']:.0f} |"
        )
    run = f"{doc['rounds']} rounds of {doc['bytes_per_pass'] / 1e9:.1f} GB in `{doc['directory']}`."
    return _join(machine_line(doc["machine"]) + " " + run, "\n".join(lines))


OFFLOAD_LABELS = {"optimizer + params on NVMe": "optimizer + parameters on NVMe"}


def offload(load: Load) -> str:
    doc = load("offload.json")
    lines = [
        "| variant | median step (s) | × in memory | read / written per step per rank (MB) "
        "| I/O busy / waited per step (s) | I/O hidden | peak RSS per rank (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in doc["summary"].items():
        hidden = "-" if s["io_hidden_share"] is None else f"{s['io_hidden_share']:.0%}"
        read, written = s["read_bytes_per_step_per_rank"], s["written_bytes_per_step_per_rank"]
        lines.append(
            f"| {OFFLOAD_LABELS.get(name, name)} | {s['median_step_s']:.2f} | {s['ratio_to_in_memory']:.2f} "
            f"| {read / 1e6:.0f} / {written / 1e6:.0f} "
            f"| {s['io_busy_s_per_step']:.2f} / {s['io_waited_s_per_step']:.2f} | {hidden} "
            f"| {s['peak_rss_bytes'] / 1e6:.0f} |"
        )
    return _join(machine_line(None, doc["meta"]["torch"]), "\n".join(lines))


def largest(load: Load) -> str:
    doc = load("largest.json")
    s = doc["summary"]
    free = s["free_disk_bytes"] / 1e9
    lines = [
        "| mode | peak RSS per rank | NVMe files per rank | largest by RAM "
        f"| largest by free disk ({free:.0f} GB) | largest here |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("in memory", "stage 3 in memory"),
        ("nvme", "stage 3, optimizer + parameters on NVMe"),
    ):
        e = s[key]
        rss = f"{e['rss_fixed_bytes'] / GIB:.2f} GiB + {e['rss_bytes_per_param_per_rank']:.1f} B × N"
        disk_per = e.get("nvme_bytes_per_param_per_rank")
        files = (
            "-"
            if disk_per is None
            else f"{disk_per:.0f} B × N ({2 * disk_per:.0f} B per element of the shard)"
        )
        by_disk = f"{e['largest_by_disk'] / 1e9:.2f}B" if "largest_by_disk" in e else "-"
        lines.append(
            f"| {label} | {rss} | {files} | {e['largest_by_ram'] / 1e9:.2f}B | {by_disk} "
            f"| **{e['largest'] / 1e9:.2f}B** |"
        )
    ram = (
        f"RAM {s['ram_bytes'] / GIB:.1f} GiB, {s['ram_budget_bytes'] / GIB:.1f} GiB of it usable by the two "
        "ranks."
    )
    v = doc.get("verify")
    check = (
        f"Verification run (`--verify-layers {v['n_layer']}`, {v['parameters'] / 1e6:.0f}M parameters): peak "
        f"{v['peak_rss_per_rank'] / GIB:.2f} GiB per rank against {v['predicted_peak_rss'] / GIB:.2f} GiB "
        "predicted by the fit."
        if v
        else ""
    )
    return _join(ram, "\n".join(lines), check)


def gpu(load: Load) -> str:
    doc = load("gpu.json")
    base = next((r for r in doc["results"] if r.get("row") == "torch" and "median_s" in r), None)
    lines = [
        "| row | step ms (min–max) | vs torch | tokens/s | model TFLOP/s | peak GPU GiB "
        "| GPU B/param between steps | model state B/param | peak RSS GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["results"]:
        if "median_s" not in r:
            lines.append(f"| {r['row']} | {'time limit' if 'skipped' in r else 'failed'} | | | | | | | |")
            continue
        ratio = f"{r['median_s'] / base['median_s']:.2f}×" if base else "–"
        per_param = f"{r['model_state_bytes_per_param']:.1f}" if "model_state_bytes_per_param" in r else "–"
        lines.append(
            f"| {r['row']} | {r['median_s'] * 1e3:.0f} ({r['min_s'] * 1e3:.0f}–{r['max_s'] * 1e3:.0f}) "
            f"| {ratio} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.0f} "
            f"| {r['peak_gpu_bytes'] / GIB:.1f} | {r['gpu_bytes_after_step'] / r['params']:.1f} "
            f"| {per_param} | {r['peak_rss_bytes'] / GIB:.1f} |"
        )
    return _join(
        f"Measured on: one {doc['device']}, torch {doc['torch']}.",
        "\n".join(lines),
        _gpu_phases(doc["results"]),
        _gpu_vs_deepspeed(doc["results"]),
    )


def _gpu_phases(results: list[dict[str, Any]]) -> str:
    """The rows' ``engine.step_breakdown()`` phases, ms per step ("" when no row has any)."""
    rows = [r for r in results if r.get("breakdown_s")]
    if not rows:
        return ""
    keys = list(dict.fromkeys(k for r in rows for k in r["breakdown_s"]))
    lines = [
        "| row | step ms | " + " | ".join(f"{k} (ms)" for k in keys) + " |",
        "| --- | --- |" + " --- |" * len(keys),
    ]
    for r in rows:
        cells = [f"{r['breakdown_s'][k] * 1e3:.0f}" if k in r["breakdown_s"] else "–" for k in keys]
        lines.append(f"| {r['row']} | {r['median_s'] * 1e3:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gpu_vs_deepspeed(results: list[dict[str, Any]]) -> str:
    """Each ``ds_<row>`` beside its zeroshard row ("" without DeepSpeed rows)."""
    by_row = {r["row"]: r for r in results}
    pairs = [(by_row.get(r["row"][3:]), r) for r in results if r["row"].startswith("ds_")]
    if not pairs:
        return ""
    version = next((" " + ds["deepspeed"] for _, ds in pairs if "deepspeed" in ds), "")
    lines = [
        f"| row | zeroshard step ms | DeepSpeed{version} step ms | DeepSpeed / zeroshard "
        "| peak GPU GiB (zeroshard / DeepSpeed) | peak RSS GiB (zeroshard / DeepSpeed) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for zs, ds in pairs:
        row = ds["row"][3:]
        if zs is None or "median_s" not in zs or "median_s" not in ds:
            failed = "DeepSpeed" if zs is not None and "median_s" in zs else "zeroshard"
            lines.append(f"| {row} | {failed} row failed or did not run | | | | |")
            continue
        lines.append(
            f"| {row} | {zs['median_s'] * 1e3:.0f} | {ds['median_s'] * 1e3:.0f} "
            f"| {ds['median_s'] / zs['median_s']:.2f} "
            f"| {zs['peak_gpu_bytes'] / GIB:.1f} / {ds['peak_gpu_bytes'] / GIB:.1f} "
            f"| {zs['peak_rss_bytes'] / GIB:.1f} / {ds['peak_rss_bytes'] / GIB:.1f} |"
        )
    return "\n".join(lines)


def gpu_largest(load: Load) -> str:
    """``bench/gpu_largest.py``: the largest GPT per offload setting on one GPU (not on the page: printed
    by the bench)."""
    doc = load("gpu_largest.json")
    m, machine = doc["model"], doc["machine"]
    gpu_memory = f" ({machine['gpu_memory_gib']} GiB)" if machine.get("gpu_memory_gib") else ""
    head = (
        f"Measured on: one {doc['device']}{gpu_memory}, {machine['cpus']} CPUs, "
        f"{machine['available_memory_gib']} GiB RAM available, {machine['free_disk_gib']} GiB free disk; "
        f"torch {doc['torch']}. GPT of width {m['n_embd']}, {m['n_head']} heads, {m['block_size']} tokens, "
        f"vocab {m['vocab_size']}, micro batch {m['micro_batch']}; search {doc['wall_s']:.0f} s of "
        f"{doc['budget_s']:.0f}."
    )
    lines = [
        "| setting | largest trained | parameters | bound | tokens/s (2nd step) | peak GPU GiB "
        "| GPU GiB between steps | peak RSS GiB | tries (layers: outcome) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in doc["settings"].values():
        tries = ", ".join(
            f"{t['n_layer']}: {t['outcome']}" + (f" ({t['reason']})" if t.get("reason") else "")
            for t in s["tries"]
            if t["outcome"] != "error"
        )
        if any(t["outcome"] == "error" for t in s["tries"]):
            tries += (", " if tries else "") + "an error (see the JSON)"
        best = s["largest"]
        if best is None:
            lines.append(f"| {s['label']} | none | | {_largest_bound(s)} | | | | | {tries} |")
            continue
        lines.append(
            f"| {s['label']} | {best['n_layer']} layers | {_billions(best['params'])} | {_largest_bound(s)} "
            f"| {best['tokens_per_s']:,.0f} | {best['peak_gpu_bytes'] / GIB:.1f} "
            f"| {best['gpu_bytes_after_step'] / GIB:.2f} | {best['peak_rss_bytes'] / GIB:.1f} | {tries} |"
        )
    by_size = doc["gpu_memory_by_size"]
    points = by_size["points"]
    sizes = "; ".join(
        f"{p['n_layer']} layers ({_billions(p['params'])}): peak {p['peak_gpu_bytes'] / GIB:.2f} GiB, "
        f"{p['gpu_bytes_after_step'] / GIB:.2f} GiB between steps"
        for p in points
    )
    label = doc["settings"][by_size["setting"]]["label"]
    if len(points) >= 2 and points[0]["n_layer"] != points[-1]["n_layer"]:
        a, b = points[0], points[-1]
        per_layer = (b["peak_gpu_bytes"] - a["peak_gpu_bytes"]) / (b["n_layer"] - a["n_layer"]) / MIB
        sizes += f" (peak +{per_layer:.0f} MiB per layer)"
    memory = f"GPU memory by size, {label}: {sizes or 'no size trained'}."
    return _join(head, "\n".join(lines), memory)


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _largest_bound(s: dict[str, Any]) -> str:
    """How far the search closed a setting's bound."""
    best = s["largest"]["n_layer"] if s["largest"] else 0
    failure = s["smallest_failure"]
    if s["tight"]:
        return "exact" if best else "1 layer does not fit"
    why = {"budget": "budget spent", "--max-layers": "--max-layers reached", "error": "stopped by an error"}
    reason = why.get(s["ended"], s["ended"])
    if not best:
        return f"not tight: < {failure} ({reason})" if failure else f"not measured ({reason})"
    return f"not tight: ≥ {best}" + (f", < {failure}" if failure else "") + f" ({reason})"


def multinode(load: Load) -> str:
    doc = load("multinode.json")
    link = doc["link"]
    lines = [
        "| row | median step (s) | × HSDP | crossed the link per step (MB) | zeroshard's count (MB) "
        "| formula (MB) | × plain: measured / formula | key in effect | peak RSS per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"].values():
        ratio = "" if r["step_ratio_to_hsdp"] is None else f"{r['step_ratio_to_hsdp']:.2f}"
        formula = "" if r["formula_bytes_per_step"] is None else f"{r['formula_bytes_per_step'] / 1e6:.1f}"
        counted = r.get("zeroshard_cross_node_bytes_per_step")
        count = "" if counted is None else f"{counted / 1e6:.1f}"
        fraction = (
            ""
            if r["fraction_of_plain_measured"] is None
            else f"{r['fraction_of_plain_measured']:.2f} / {r['fraction_of_plain_formula']:.2f}"
        )
        effect = {None: "", True: "yes", False: "no (zeroshard warns: no effect)"}[r["key_in_effect"]]
        lines.append(
            f"| {r['label']} | {r['median_step_s']:.2f} | {ratio} "
            f"| {r['cross_node_bytes_per_step'] / 1e6:.1f} | {count} | {formula} | {fraction} | {effect} "
            f"| {r['peak_rss_bytes'] / MIB:.0f} |"
        )
    s = doc["settings"]
    run = (
        f"{doc['num_parameters'] / 1e6:.1f}M parameters (Ψ = {doc['psi_bytes'] / 1e6:.0f} MB), "
        f"{s['micro_batch']} × {s['seq_len']} tokens per rank, {s['steps']} timed steps; "
        f"{s['nodes']} namespaces × {s['ranks_per_node']} ranks; link `tbf rate {link['rate']}`, "
        f"{link['across_gbit_per_s']:.2f} Gbit/s measured across it "
        f"({link['inside_node_gbit_per_s']:.1f} inside a namespace, "
        f"{link['inside_node_veth_tx_bytes']} bytes of that on the veth); "
        f"{doc['wall_s'] / 60:.1f} min, load average {doc['machine']['loadavg_before'][0]:.1f} before and "
        f"{doc['machine']['loadavg_after'][0]:.1f} after."
    )
    return _join(machine_line(doc["machine"]) + " " + run, "\n".join(lines))


def quantized(load: Load) -> str:
    doc = load("quantized.json")
    columns = ["run", "gathered per step (MiB)", "× plain", "reduce-scattered per step (MiB)", "× plain"]
    columns += ["loss, last 20 steps", "× plain", "largest gap to plain"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, row in doc["rows"].items():
        b, f = row["bytes_by_op"], row["bytes_fraction_of_plain"]
        lines.append(
            f"| {name} | {b.get('all_gather', 0) / MIB:.2f} | {f.get('all_gather', 0):.3f} "
            f"| {b.get('reduce_scatter', 0) / MIB:.2f} | {f.get('reduce_scatter', 0):.3f} "
            f"| {row['final_loss']:.4f} | {1 + row['final_loss_vs_plain']:.4f} "
            f"| {row['max_gap_to_plain']:.4f} |"
        )
    m = doc["model"]
    run = (
        f"GPT of {m['n_layer']} layers, width {m['n_embd']}, vocab {m['vocab_size']}; "
        f"{doc['steps']} steps of {doc['micro_batch']} × {m['block_size']} tokens per rank "
        f"at W = {doc['world_size']}; "
        f"{doc['wall_s'] / 60:.1f} min."
    )
    return _join(" ".join(p for p in (machine_line(doc.get("machine")), run) if p), "\n".join(lines))
