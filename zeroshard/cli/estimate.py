"""`zeroshard estimate`: model-state memory per GPU and per node for every stage and offload option."""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict
from typing import Any

from zeroshard.estimate import (
    DTYPE_BYTES,
    OFFLOAD_OPTIONS,
    MemoryEstimate,
    estimate_memory,
    model_size_from_hf_config,
)

__all__ = ["format_bytes", "parse_count", "plot_estimate", "register", "render_table"]

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """Parses a parameter count: "7e9", "7B", "1.3b", "125M", "350_000_000".

    Raises:
        argparse.ArgumentTypeError: When the text is not a whole count >= 1.
    """
    match = _COUNT.match(text.replace("_", "").replace(",", ""))
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; write e.g. 7e9, 7B, 1.3B or 125M")
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole count >= 1")
    return int(value)


def format_bytes(nbytes: int) -> str:
    """Bytes as GB (1e9) with at most two decimals and no trailing zeros: 38.5, 26.25, 112."""
    gb = nbytes / 1e9
    if gb == 0 or gb >= 1:
        return f"{gb:.2f}".rstrip("0").rstrip(".")
    return f"{gb:.3g}"


def render_table(estimate: MemoryEstimate) -> str:
    """The estimate as an aligned text table, GB = 1e9 bytes, with a header line saying what was assumed."""
    precision = "fp32 Adam" if estimate.dtype == "fp32" else f"{estimate.dtype} mixed-precision Adam"
    plural = "s" if estimate.nodes > 1 else ""
    lines = [
        f"Model states (ZeRO formulas) for {estimate.num_parameters:,} parameters, {precision}, "
        f"{estimate.world_size} GPUs ({estimate.gpus_per_node} per node x {estimate.nodes} node{plural}); "
        "GB = 1e9 bytes",
    ]
    show_layer = estimate.largest_layer is not None
    header = ["stage", "offload", "params", "grads", "optimizer"]
    header += ["layer"] if show_layer else []
    header += ["per GPU", "CPU/node", "NVMe/node"]
    table = [header]
    for row in estimate.rows:
        cells = [
            str(row.stage),
            row.offload,
            *(format_bytes(b) for b in (row.gpu.parameters, row.gpu.gradients, row.gpu.optimizer_state)),
        ]
        cells += [format_bytes(row.gpu_working)] if show_layer else []
        cells += [format_bytes(row.per_gpu), format_bytes(row.cpu_per_node), format_bytes(row.nvme_per_node)]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for r in table:
        left = [r[0].ljust(widths[0]), r[1].ljust(widths[1])]
        lines.append("  ".join(left + [c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)]).rstrip())
    lines.append(
        "params/grads/optimizer/per GPU: GB on each GPU; CPU/node, NVMe/node: GB of offloaded state on each "
        "node. Activations and buffers come on top."
    )
    if not show_layer and any(row.stage == 3 for row in estimate.rows):
        lines.append(
            "Stage 3 also gathers its largest layer on the GPU: pass --largest-layer (or --model) to count it"
        )
    return "\n".join(lines)


def plot_estimate(estimate: MemoryEstimate, path: str) -> None:
    """Saves a bar chart of the estimate: stacked GPU bytes per row, and CPU / NVMe bytes per node.

    Raises:
        ImportError: When matplotlib is not installed (the message gives the pip command).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: render straight to the file
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib: pip install 'zeroshard[plot]' (or pip install matplotlib)"
        ) from None
    labels = [f"stage {row.stage}\n" + row.offload.replace("+", "+\n") for row in estimate.rows]
    xs = list(range(len(labels)))
    fig, (ax_gpu, ax_host) = plt.subplots(2, 1, figsize=(max(8.0, 1.0 * len(labels)), 8.5))
    bottom = [0.0] * len(xs)
    parts: list[tuple[str, list[float]]] = [
        ("parameters", [row.gpu.parameters / 1e9 for row in estimate.rows]),
        ("gradients", [row.gpu.gradients / 1e9 for row in estimate.rows]),
        ("optimizer state", [row.gpu.optimizer_state / 1e9 for row in estimate.rows]),
    ]
    if estimate.largest_layer is not None:
        parts.append(("gathered layer", [row.gpu_working / 1e9 for row in estimate.rows]))
    for name, values in parts:
        ax_gpu.bar(xs, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax_gpu.annotate(format_bytes(int(total * 1e9)), (x, total), ha="center", va="bottom", fontsize=8)
    ax_gpu.set_title("per GPU")
    width = 0.4
    cpu = [row.cpu_per_node / 1e9 for row in estimate.rows]
    nvme = [row.nvme_per_node / 1e9 for row in estimate.rows]
    ax_host.bar([x - width / 2 for x in xs], cpu, width, label="CPU memory")
    ax_host.bar([x + width / 2 for x in xs], nvme, width, label="NVMe")
    for x, c, v in zip(xs, cpu, nvme, strict=True):
        for offset, value in ((-width / 2, c), (width / 2, v)):
            if value:
                ax_host.annotate(
                    format_bytes(int(value * 1e9)), (x + offset, value), ha="center", va="bottom", fontsize=8
                )
    ax_host.set_title("offloaded state, per node")
    for ax in (ax_gpu, ax_host):
        ax.set_xticks(xs, labels, fontsize=8)
        ax.set_xlabel("ZeRO stage / offload")
        ax.set_ylabel("GB (1e9 bytes)")
        ax.legend(fontsize=8)
    precision = "fp32" if estimate.dtype == "fp32" else f"{estimate.dtype} mixed precision"
    fig.suptitle(
        f"Model states, {estimate.num_parameters / 1e9:.3g}B parameters, Adam, {precision}, "
        f"{estimate.world_size} GPUs ({estimate.gpus_per_node}/node)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run(args: argparse.Namespace) -> int:
    try:
        largest = args.largest_layer
        if args.model is not None:
            size = model_size_from_hf_config(args.model)
            params = size.num_parameters
            largest = largest if largest is not None else size.largest_layer
            print(
                f"{args.model}: {size.family}-style model, {params:,} parameters, "
                f"largest layer {size.largest_layer:,}"
            )
        else:
            params = args.params
        estimate = estimate_memory(
            params,
            gpus_per_node=args.gpus_per_node,
            nodes=args.nodes,
            dtype=args.dtype,
            largest_layer=largest,
            offload=args.offload,
            mics_shard_size=args.mics_shard_size,
            hpz_partition_size=args.hpz_partition_size,
        )
        if args.json:
            rows: list[dict[str, Any]] = [{**asdict(r), "per_gpu": r.per_gpu} for r in estimate.rows]
            print(json.dumps({**asdict(estimate), "world_size": estimate.world_size, "rows": rows}, indent=2))
        else:
            print(render_table(estimate))
        if args.plot is not None:
            plot_estimate(estimate, args.plot)
            print(f"plot written to {args.plot}")
    except (ValueError, ImportError, OSError) as err:
        print(f"zeroshard estimate: error: {err}", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    """Adds `zeroshard estimate` to `subparsers`."""
    parser = subparsers.add_parser(
        "estimate",
        help="memory per GPU and per node for every ZeRO stage and offload option",
        description="Model-state memory (parameters, gradients, optimizer state) per GPU and per node, "
        "from the ZeRO paper's formulas, for every stage and offload option. Activations are not included.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=parse_count, help="trainable parameters: 7e9, 7B, 125M, ...")
    source.add_argument(
        "--model", metavar="CONFIG_JSON", help="a Hugging Face config.json to count parameters from"
    )
    parser.add_argument(
        "--largest-layer",
        type=parse_count,
        default=None,
        help="parameters of the largest layer (stage 3 gathers it on the GPU)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPE_BYTES),
        default="bf16",
        help="bf16/fp16: mixed precision with fp32 master weights; fp32: full precision (default bf16)",
    )
    parser.add_argument(
        "--offload",
        nargs="+",
        choices=list(OFFLOAD_OPTIONS),
        default=None,
        help="offload options to show (default: all)",
    )
    parser.add_argument(
        "--mics-shard-size",
        type=int,
        default=-1,
        metavar="S",
        help="hybrid sharding (zero_optimization.mics_shard_size): the state sharded over S ranks "
        "(default -1: off)",
    )
    parser.add_argument(
        "--hpz-partition-size",
        type=int,
        default=1,
        metavar="H",
        help="ZeRO++ hpZ (zero_optimization.zero_hpz_partition_size): stage 3's secondary shards over H "
        "ranks (default 1: off)",
    )
    parser.add_argument(
        "--plot", metavar="PNG", default=None, help="also save a bar chart (needs matplotlib)"
    )
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON instead of a table")
    parser.set_defaults(func=_run)
