"""One GPU: the largest GPT each offload setting trains on this GPU and host, stage 3 in bf16.

    python bench/gpu_largest.py --budget-s 300                      # needs a CUDA GPU
    python bench/gpu_largest.py --quick --device cpu --budget-s 60   # check it, no GPU

``--device cpu`` (with ``--quick``) runs the search on a machine without a GPU, on tiny GPTs up to
``--max-layers`` (default 8 with ``--quick``, else 512). Its figures mean nothing.

For each setting (no offload; optimizer on CPU; optimizer and parameters on CPU; both on NVMe under
``$ZEROSHARD_BENCH_NVME`` or a temporary directory) the GPT of width 4096 (32 heads, 1024 tokens, vocab
32768, micro batch 1) with the most layers that trains two steps, stage 3 in bf16. Each try runs in a fresh
process (bench/gpu_largest_try.py) that builds the model in bf16 under
``zero.Init(remote_device=..., dtype=bf16)``, so it is never whole on the GPU and never in fp32; running out
of GPU memory, host memory or disk means it does not fit (the bench stops a child when the host's available
memory falls below 3 GiB, before the kernel's OOM killer picks a process). The search starts at a size
predicted to fit (80% of what assumed bytes per parameter allow on this GPU, RAM and disk; at most 4 layers
on NVMe, whose every try moves ~70 bytes per parameter through the disk), doubles while it fits, then
bisects, the settings taking turns (the first turn stops a try after 1.5 times its share of the budget left,
so a slow setting leaves time to the next); ``--budget-s`` (all settings together) ends it, and a bound it
did not close is reported as not tight. Per setting: the largest that trained, its parameters, the tokens/s
of its second step, peak GPU memory, peak RSS; for optimizer and parameters on CPU also the GPU memory at a
second, smaller size. The weights are filled from a repeated random pattern, not drawn by ``nn.init``
(memory and speed do not depend on the values; drawing 10^10 random numbers takes minutes on a CPU). Results
go to ``bench/results/gpu_largest.json`` and a Markdown table.

The rows (throughput and memory of each path on a GPT of ~1.3B parameters) are bench/gpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from gpu_common import GIB, Child, child_env, mem_available, on_sigterm, run_child, write_results
from gpu_largest_try import MICRO_BATCH, SETTINGS, Setting, no_fit_reason, try_main

LARGE = {"vocab_size": 32768, "block_size": 1024, "n_head": 32, "n_embd": 4096}
LARGE_QUICK = {"vocab_size": 1024, "block_size": 64, "n_head": 4, "n_embd": 128}
START_FRACTION = 0.8  # of the predicted largest: the first try should fit
NVME_START_LAYERS = 4
MIN_TRY_S = 15.0  # a try is not started with less of the budget left
GPU_RESERVE = 3 * GIB  # CUDA context, workspaces, logits
HOST_RESERVE = 6 * GIB  # the interpreter, torch's and CUDA's libraries
ACTIVATION_BYTES = 40  # per layer, token and unit of width without recomputation (~34 in bf16, rounded up)
MIN_AVAILABLE = 3 * GIB  # host memory the bench keeps free: a child that takes it is stopped
TWO_SIZES = "zero3_offload_all"  # the setting whose GPU memory is shown at two sizes


def gpt_params(n_layer: int, model: dict[str, Any]) -> int:
    """Parameters of examples/train_gpt.py's GPT (the LM head is tied to the token embedding)."""
    c = model["n_embd"]
    return int(n_layer * (12 * c * c + 13 * c) + (model["vocab_size"] + model["block_size"] + 2) * c)


def predicted_layers(setting: Setting, model: dict[str, Any], limits: dict[str, float], cap: int) -> int:
    """The most layers (at most ``cap``) within the GPU, host and disk limits at the assumed bytes."""
    act = ACTIVATION_BYTES * model["block_size"] * model["n_embd"] * MICRO_BATCH
    best = 0
    for n in range(1, cap + 1):
        p = gpt_params(n, model)
        if setting.gpu_bytes * p + n * act + GPU_RESERVE > 0.95 * limits["gpu"]:
            break
        if setting.host_bytes * p + HOST_RESERVE > 0.9 * limits["host"]:
            break
        if setting.disk_bytes * p > 0.9 * limits["disk"]:
            break
        best = n
    return best


def next_size(start: int, fits: list[int], fails: list[int], cap: int) -> int | None:
    """The next layer count to try: ``start``; doubling while everything fits; halving while nothing does;
    then bisecting between the largest fit and the smallest failure above it. None when the bound is closed
    (or ``cap`` fits, or 1 does not)."""
    lo = max(fits, default=0)
    above = [n for n in fails if n > lo]
    hi = min(above) if above else None
    if not fits and not fails:
        return start
    if hi is None:
        return None if lo >= cap else min(2 * lo, cap)
    if lo == 0:
        return None if hi <= 1 else hi // 2
    return None if hi - lo <= 1 else (lo + hi) // 2


@dataclass
class Search:
    """One setting's search: its tries, and why it ended (None while it goes on)."""

    name: str
    predicted: int
    start: int
    cap: int
    tries: list[dict[str, Any]] = field(default_factory=list)
    ended: str | None = None

    def sizes(self, outcome: str) -> list[int]:
        return [t["n_layer"] for t in self.tries if t["outcome"] == outcome]

    def next(self) -> int | None:
        if self.ended is not None:
            return None
        n = next_size(self.start, self.sizes("fits"), self.sizes("does not fit"), self.cap)
        if n is None:
            fits = self.sizes("fits")
            self.ended = "nothing fits" if not fits else "--max-layers" if max(fits) >= self.cap else "closed"
        return n

    def summary(self) -> dict[str, Any]:
        self.next()  # sets ``ended`` if the last try closed the bound
        fitted = sorted((t for t in self.tries if t["outcome"] == "fits"), key=lambda t: t["n_layer"])
        best = fitted[-1]["result"] if fitted else None
        lo = best["n_layer"] if best else 0
        above = [n for n in self.sizes("does not fit") if n > lo]
        failure = min(above) if above else None
        return {
            "label": SETTINGS[self.name].label,
            "predicted_layers": self.predicted,
            "start_layers": self.start,
            "tries": self.tries,
            "largest": best,
            "smallest_failure": failure,
            "tight": failure == lo + 1,
            "ended": self.ended or "budget",
        }


def _outcome(child: Child) -> tuple[str, str | None, dict[str, Any] | None]:
    """``(outcome, reason, result)`` of a try: fits, does not fit, out of budget, or error."""
    line = child.line("RESULT")
    if line is not None:
        return "fits", None, json.loads(line)
    if child.stopped == "host memory":
        return "does not fit", f"host memory (available fell below {MIN_AVAILABLE / GIB:.0f} GiB)", None
    if child.stopped == "time limit":
        return "out of budget", None, None
    line = child.line("NOFIT")
    if line is not None:
        return "does not fit", json.loads(line)["reason"], None
    if child.returncode == -signal.SIGKILL:
        return "does not fit", "killed by SIGKILL (the kernel's OOM killer)", None
    reason = no_fit_reason(child.stderr)
    return ("does not fit", reason, None) if reason else ("error", child.tail(), None)


def _limits(device: str, nvme_path: str) -> dict[str, Any]:
    """GPU memory (from a probe child: this process makes no CUDA context), available RAM, free disk."""
    host, disk = mem_available(), shutil.disk_usage(nvme_path).free
    if device != "cuda":
        return {"gpu": float("inf"), "host": host, "disk": disk, "name": "CPU (--device cpu)"}
    probe = (
        "import json, torch; free, total = torch.cuda.mem_get_info(); "
        "print(json.dumps({'name': torch.cuda.get_device_name(), 'total': total}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    gpu = json.loads(done.stdout.strip().splitlines()[-1])
    return {"gpu": gpu["total"], "host": host, "disk": disk, "name": gpu["name"]}


class LargestRun:
    """The search: each setting's :class:`Search`, taking turns within ``--budget-s``."""

    def __init__(self, args: argparse.Namespace, model: dict[str, Any], nvme_path: str) -> None:
        self.args, self.model, self.nvme_path = args, model, nvme_path
        self.began = time.monotonic()
        self.deadline = self.began + args.budget_s
        self.limits = _limits(args.device, nvme_path)
        self.searches: dict[str, Search] = {}
        for name, setting in SETTINGS.items():
            predicted = predicted_layers(setting, model, self.limits, args.max_layers)
            start = max(1, int(START_FRACTION * predicted))
            if setting.params == "nvme":
                start = max(1, min(predicted, NVME_START_LAYERS))
            self.searches[name] = Search(name, predicted, start, args.max_layers)

    def run(self) -> None:
        """1. each setting once, within its share of what is left (so that a slow one leaves time to those
        after it); 2. the second, smaller size of ``TWO_SIZES``; 3. in turn until every bound is closed. Ends
        when the budget has no room for another try."""
        first = list(self.searches.values())
        for i, search in enumerate(first):
            n = search.next()
            share = 1.5 * (self.deadline - time.monotonic()) / (len(first) - i)
            if n is not None and not self.attempt(search, n, share):
                return
        pair = self.searches[TWO_SIZES]
        fits = pair.sizes("fits")
        if len(set(fits)) == 1 and fits[0] > 1 and not self.attempt(pair, fits[0] // 2):
            return
        while going := [s for s in self.searches.values() if s.next() is not None]:
            for search in going:
                n = search.next()
                if n is not None and not self.attempt(search, n):
                    return

    def attempt(self, search: Search, n_layer: int, share_s: float | None = None) -> bool:
        """Try ``n_layer`` layers in a child, stopped after ``share_s`` seconds or at the deadline. False
        when the budget has no room for a try."""
        left = self.deadline - time.monotonic()
        if left < MIN_TRY_S:
            return False
        limit = left if share_s is None else min(left, share_s)
        cmd = [sys.executable, __file__, "--try", f"{search.name}:{n_layer}", "--device", self.args.device]
        cmd += ["--nvme-path", self.nvme_path] + (["--quick"] if self.args.quick else [])
        child = run_child(cmd, child_env(search.name, self.args.device), limit, MIN_AVAILABLE)
        for leftover in Path(self.nvme_path).iterdir():  # a killed child leaves its NVMe files behind
            if leftover.is_file():
                leftover.unlink()
        outcome, reason, result = _outcome(child)
        if outcome == "out of budget":
            reason = f"stopped after {limit:.0f} s"
            search.ended = "budget"
        elif outcome == "error":
            search.ended = "error"
        search.tries.append(
            {
                "n_layer": n_layer,
                "outcome": outcome,
                "reason": reason,
                "wall_s": child.wall_s,
                "result": result,
            }
        )
        if result is not None:
            reason = (
                f"{_billions(result['params'])}, 2nd step {result['step_s'][1]:.2f} s, peak GPU "
                f"{result['peak_gpu_bytes'] / GIB:.1f} GiB, peak RSS {result['peak_rss_bytes'] / GIB:.1f} GiB"
            )
        left = self.deadline - time.monotonic()
        print(
            f"{search.name} {n_layer} layers: {outcome} ({reason}; {child.wall_s:.0f} s, {left:.0f} s left)",
            flush=True,
        )
        if outcome == "error":
            print(child.tail(), flush=True)
        if self.args.out:  # each try kept at once: a run killed from outside still leaves what it found
            Path(self.args.out).write_text(json.dumps(self.doc(), indent=2))
        return True

    def doc(self) -> dict[str, Any]:
        tries = self.searches[TWO_SIZES].tries
        points = sorted((t["result"] for t in tries if t["outcome"] == "fits"), key=lambda r: r["n_layer"])
        gpu = self.limits["gpu"]
        return {
            "device": self.limits["name"],
            "torch": torch.__version__,
            "machine": {
                "cpus": os.cpu_count(),
                "available_memory_gib": round(self.limits["host"] / GIB, 1),
                "gpu_memory_gib": None if gpu == float("inf") else round(gpu / GIB, 1),
                "free_disk_gib": round(self.limits["disk"] / GIB, 1),
            },
            "model": {**self.model, "micro_batch": MICRO_BATCH},
            "budget_s": self.args.budget_s,
            "wall_s": time.monotonic() - self.began,
            "settings": {name: search.summary() for name, search in self.searches.items()},
            "gpu_memory_by_size": {"setting": TWO_SIZES, "points": points},
        }


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small GPTs: a smoke test")
    parser.add_argument("--budget-s", type=float, default=300.0, help="seconds for the whole search")
    parser.add_argument("--max-layers", type=int, help="try no more layers (default 512; --quick 8)")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu (with --quick): check the script here"
    )
    parser.add_argument("--out", help="results file (default bench/results/gpu_largest.json)")
    parser.add_argument("--try", dest="try_", help=argparse.SUPPRESS)  # internal: one try, in this process
    parser.add_argument("--nvme-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench/gpu_largest.py needs a CUDA GPU (--device cpu --quick checks the script without one)"
        )
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu needs --quick (GPTs of width 4096 on a CPU would take hours)")
    model = LARGE_QUICK if args.quick else LARGE
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.try_:
        try_main(args.try_, model, args.device, args.nvme_path)
    args.max_layers = args.max_layers or (8 if args.quick else 512)
    base = os.environ.get("ZEROSHARD_BENCH_NVME") or tempfile.gettempdir()
    nvme_path = tempfile.mkdtemp(prefix="zeroshard-gpu-largest-", dir=base)
    try:
        run = LargestRun(args, model, nvme_path)
        try:
            run.run()
        finally:  # also when stopped by SIGTERM (on_sigterm raises SystemExit)
            write_results("gpu_largest", args.out, run.doc())
    finally:
        shutil.rmtree(nvme_path, ignore_errors=True)


if __name__ == "__main__":
    main()
