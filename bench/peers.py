"""zeroshard against its peers on one GPT, one machine, one session (issue 7).

    .venv/bin/python bench/peers.py                 # both sizes; DeepSpeed rows when bench/.venv-peers exists
    .venv/bin/python bench/peers.py --size small    # only the ~10M speed model (the other size is kept)
    .venv/bin/python bench/peers.py --quick         # tiny, 3 steps, torch peers + zeroshard (smoke test)

Systems, at W=2 on gloo/CPU, fp32 AdamW (lr 1e-3, wd 0.01), gradient clipping 1.0: PyTorch DDP, torch
``ZeroRedundancyOptimizer`` (stage-1 peer), FSDP2 ``fully_shard`` with ``reshard_after_forward=False``
(stage-2 peer) and with resharding (stage-3 peer), zeroshard stages 0-3, and DeepSpeed stages 0-3 (run by the
interpreter of ``bench/.venv-peers``, ``DS_ACCELERATOR=cpu``). Every (round, system) is a fresh process pair
started by a fresh interpreter; systems are interleaved (A B C A B C ...) and every figure is also given as a
ratio to DDP of the same round. Raw results: ``bench/results/peers.json`` (``peers_quick.json`` for --quick);
``docs/benchmarks.md``'s peers section and ``docs/bench_*.png`` are regenerated from it (not for --quick).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: common sets OMP_NUM_THREADS and MALLOC_MMAP_THRESHOLD_ before torch is imported.
from common import (
    CLIP,
    LR,
    ROOT,
    WEIGHT_DECAY,
    WORLD_SIZE,
    build_gpt,
    ds_config,
    peak_rss,
    rss,
    run_pair,
    tokens_for,
)

# isort: split
import torch
import torch.distributed as dist

PEERS_PY = ROOT / "bench" / ".venv-peers" / "bin" / "python"
RESULTS = ROOT / "bench" / "results"

SIZES: dict[str, dict[str, Any]] = {
    # PEERS.md's small model (speed): 8 x 128 tokens per step.
    "small": {
        "model": {"vocab_size": 8192, "block_size": 128, "n_layer": 4, "n_head": 6, "n_embd": 384},
        "micro_batch": 4,
        "warmup": 3,
        "steps": 10,
        "rounds": 2,
    },
    # PEERS.md's large model (memory): 4 x 128 tokens per step.
    "large": {
        "model": {"vocab_size": 16384, "block_size": 128, "n_layer": 12, "n_head": 16, "n_embd": 1024},
        "micro_batch": 2,
        "warmup": 2,
        "steps": 10,
        "rounds": 1,
    },
    "quick": {
        "model": {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
        "micro_batch": 2,
        "warmup": 1,
        "steps": 3,
        "rounds": 1,
    },
}

# system -> (ZeRO stage it is compared at, where it runs)
SYSTEMS: dict[str, tuple[int, str]] = {
    "ddp": (0, "torch"),
    "torch-zero1": (1, "torch"),
    "fsdp2-noreshard": (2, "torch"),
    "fsdp2": (3, "torch"),
    **{f"zeroshard-stage{s}": (s, "zeroshard") for s in range(4)},
    **{f"deepspeed-stage{s}": (s, "deepspeed") for s in range(4)},
}

# Bytes one rank moves per step, in units of 4N (fp32), counted as zeroshard's ``comm.stats`` counts them: a
# ring all-reduce 2 x its buffer, an all-gather, reduce-scatter or broadcast-all 1 x the full buffer. The
# formula used for the peers (they expose no counter).
COMM_FORMULA_4N = {
    "ddp": 2,  # all-reduce gradients
    "torch-zero1": 3,  # all-reduce gradients, broadcast updated shards
    "fsdp2-noreshard": 2,  # all-gather once, reduce-scatter gradients
    "fsdp2": 3,  # all-gather forward and backward, reduce-scatter
    "deepspeed-stage0": 2,  # all-reduce
    "deepspeed-stage1": 2,  # reduce-scatter gradients, all-gather parameters
    "deepspeed-stage2": 2,
    "deepspeed-stage3": 3,
}

# ZeRO's model-state bytes per parameter per rank for fp32 Adam at W=2: 4 params + 4 grads + 8 Adam.
ZERO_FORMULA = {0: 16.0, 1: 4 + 4 + 8 / WORLD_SIZE, 2: 4 + 12 / WORLD_SIZE, 3: 16 / WORLD_SIZE}


# ----------------------------------------------------------------------------------------------- workers


def reachable_tensor_bytes(roots: list[Any]) -> int:
    """Bytes of distinct storages reachable from ``roots`` (params, their grads, optimizer objects' state).

    Used for the peers, which have no memory breakdown: walks dicts, lists and the attributes of optimizer
    and DeepSpeed objects a few levels deep, counting each storage once (DTensors by their local shard).
    """
    seen: set[int] = set()
    visited: set[int] = set()
    total = 0

    def visit(o: Any, depth: int) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            extras = (o.grad, getattr(o, "ds_tensor", None))  # read before a DTensor becomes its local shard
            if type(o).__name__ == "DTensor":
                o = o.to_local()
            if o.device.type != "meta":
                st = o.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
            for extra in extras:
                if extra is not None:
                    visit(extra, depth)
            return
        if depth > 8 or id(o) in visited:
            return
        visited.add(id(o))
        if isinstance(o, dict):
            for k, v in o.items():
                visit(k, depth + 1)
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple, set)):
            for v in o:
                visit(v, depth + 1)
        elif isinstance(o, torch.optim.Optimizer) or type(o).__module__.startswith("deepspeed.runtime"):
            visit(vars(o), depth + 1)

    for r in roots:
        visit(r, 0)
    return total


def _torch_system(system: str, model: torch.nn.Module) -> tuple[Any, Any, list[Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if system in ("ddp", "torch-zero1"):
        ddp = DDP(model, gradient_as_bucket_view=True)
        if system == "ddp":
            opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY
            )
        return ddp, opt, [list(model.parameters()), opt]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    reshard = system == "fsdp2"
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, opt, [list(model.parameters()), opt]


def worker(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One system on one rank: build, warm up, time ``steps`` steps. Collective: both ranks run it."""
    system = spec["system"]
    kind = SYSTEMS[system][1]
    if kind == "deepspeed":
        # DeepSpeed reads these even when the process group is already up (it asserts on LOCAL_RANK).
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        import deepspeed  # imported before the baseline: the library's own footprint is not model state
    elif kind == "zeroshard":
        import zeroshard
    baseline = rss()
    model = build_gpt(spec["model"])
    n_params = sum(p.numel() for p in model.parameters())
    engine: Any = None
    if kind == "zeroshard":
        engine, _, _, _ = zeroshard.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ds_config(spec["zero"], spec["micro_batch"]),
        )
    elif kind == "deepspeed":
        cfg = ds_config(spec["zero"], spec["micro_batch"])
        cfg["optimizer"]["params"]["torch_adam"] = True  # no fused Adam op on CPU (DS_BUILD_OPS=0)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg, dist_init_required=False
        )
    else:
        fwd, opt, roots = _torch_system(system, model)
    n_steps = spec["warmup"] + spec["steps"]
    tokens = tokens_for(rank, n_steps, spec["micro_batch"], spec["model"])

    state = 0

    def step(i: int) -> float:
        nonlocal state
        x, y = tokens[i, :, :-1], tokens[i, :, 1:]
        if engine is not None:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        else:
            loss = fwd(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            if i == n_steps - 1:  # gradients are still allocated: count them with the rest of the state
                state = reachable_tensor_bytes(roots)
            opt.zero_grad()
        return float(loss.item())

    losses = [step(i) for i in range(spec["warmup"])]
    dist.barrier()
    bytes0 = engine.comm.stats.total_bytes if kind == "zeroshard" else 0
    times: list[float] = []
    for i in range(spec["warmup"], n_steps):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
    if kind == "zeroshard":
        state = engine.memory_breakdown().total
        comm = (engine.comm.stats.total_bytes - bytes0) / spec["steps"]
    else:
        if kind == "deepspeed":
            state = reachable_tensor_bytes([list(model.parameters()), engine.optimizer])
        comm = None
    return {
        "times": times,
        "losses": losses,
        "num_parameters": n_params,
        "model_state_bytes": state,
        "comm_bytes_per_step_measured": comm,
        "rss_baseline_bytes": baseline,
        "peak_rss_above_baseline_bytes": peak_rss() - baseline,
    }


def zero_block(system: str) -> dict[str, Any]:
    stage = SYSTEMS[system][0]
    return {"stage": stage}


# ------------------------------------------------------------------------------------------------ parent


def reference_losses(size: dict[str, Any]) -> list[float]:
    """Single-process training on both ranks' tokens concatenated: the losses every system should match."""
    torch.set_num_threads(1)
    model = build_gpt(size["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    n = size["warmup"] + size["steps"]
    toks = torch.cat([tokens_for(r, n, size["micro_batch"], size["model"]) for r in range(WORLD_SIZE)], dim=1)
    out = []
    for i in range(n):
        loss = model(toks[i, :, :-1], toks[i, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append(float(loss.item()))
    return out


def run_system(system: str, size: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """One fresh process pair for ``system``, started by the right interpreter; per-rank results."""
    spec = {"name": system, "runs": [{**size, "system": system, "zero": zero_block(system)}]}
    python = str(PEERS_PY) if SYSTEMS[system][1] == "deepspeed" else sys.executable
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_file.write_text(json.dumps(spec))
        proc = subprocess.run(
            [python, __file__, "--pair", str(spec_file), str(out_file)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{system} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return [r[0] for r in json.loads(out_file.read_text())]


def summarise(rounds: list[dict[str, list[dict[str, Any]]]], ref: list[float]) -> dict[str, Any]:
    """Per system: pooled step times, in-round ratios to DDP (median over rounds), memory, comm, loss."""
    out: dict[str, Any] = {}
    systems = list(rounds[0])
    n = rounds[0]["ddp"][0]["num_parameters"]
    for name in systems:
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
        measured = rounds[-1][name][0]["comm_bytes_per_step_measured"]
        stage = SYSTEMS[name][0]
        out[name] = {
            "stage": stage,
            "median_s": statistics.median(steps),
            "min_s": min(steps),
            "max_s": max(steps),
            "step_ratio_to_ddp": statistics.median(ratios),
            "step_ratio_to_ddp_per_round": ratios,
            "peak_rss_above_baseline_bytes": peak(name),
            "peak_rss_ratio_to_ddp": peak(name) / peak("ddp"),
            "model_state_bytes": state(name),
            "model_state_ratio_to_ddp": state(name) / state("ddp"),
            "zero_formula_bytes": ZERO_FORMULA[stage] * n,
            "comm_bytes_per_step": measured if measured is not None else 4 * n * COMM_FORMULA_4N[name],
            "comm_source": "measured" if measured is not None else "formula",
            "max_abs_loss_diff": loss_err,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, torch peers + zeroshard")
    parser.add_argument("--size", choices=["small", "large", "both"], default="both")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (defaults: small 2, large 1)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default 10)")
    parser.add_argument("--only", nargs="+", help="run only these systems (ddp is always included)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    parser.add_argument("--out", type=Path, help="JSON output (default bench/results/peers[_quick].json)")
    parser.add_argument("--no-docs", action="store_true", help="do not regenerate docs/benchmarks.md")
    parser.add_argument(
        "--resummarise",
        action="store_true",
        help="recompute summaries and docs from the raw results in --out",
    )
    parser.add_argument("--pair", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pair:  # child interpreter: one process pair, results to a file
        spec = json.loads(Path(args.pair[0]).read_text())
        Path(args.pair[1]).write_text(json.dumps(run_pair(worker, spec)))
        return

    if args.resummarise:
        path = args.out or RESULTS / "peers.json"
        doc = json.loads(path.read_text())
        for size in doc["sizes"].values():
            size["summary"] = summarise(size["raw"], size["reference_losses"])
        path.write_text(json.dumps(doc, indent=1))
        import report

        report.write_docs(doc)
        return
    sizes = ["quick"] if args.quick else (["small", "large"] if args.size == "both" else [args.size])
    use_ds = not args.no_deepspeed and PEERS_PY.exists() and (not args.quick or bool(args.only))
    systems = [s for s, (_, where) in SYSTEMS.items() if where != "deepspeed" or use_ds]
    if args.only:
        systems = [s for s in systems if s == "ddp" or s in args.only]
    out_path = args.out or RESULTS / ("peers_quick.json" if args.quick else "peers.json")
    doc: dict[str, Any] = json.loads(out_path.read_text()) if out_path.exists() and not args.quick else {}
    doc.setdefault("sizes", {})
    for size_name in sizes:
        size = dict(SIZES[size_name])
        size["rounds"] = args.rounds or size["rounds"]
        size["steps"] = args.steps or size["steps"]
        t0 = time.time()
        load_before = os.getloadavg()
        ref = reference_losses(size)
        rounds: list[dict[str, list[dict[str, Any]]]] = []
        # --quick: one process pair runs every system in turn (spawning costs seconds per pair), so its peak
        # RSS figures are cumulative and mean nothing; it checks that every system runs and agrees in loss.
        if args.quick:
            local = [s for s in systems if SYSTEMS[s][1] != "deepspeed"]
            runs = [{**size, "system": s, "zero": zero_block(s)} for s in local]
            per_rank = run_pair(worker, {"name": "quick", "runs": runs})
            rnd0 = {s: [per_rank[k][i] for k in range(WORLD_SIZE)] for i, s in enumerate(local)}
            # DeepSpeed needs its own interpreter: one pair per system.
            rnd0.update({s: run_system(s, size, timeout=600) for s in systems if s not in rnd0})
            rounds.append(rnd0)
        for r in range(0 if args.quick else size["rounds"]):
            rnd: dict[str, list[dict[str, Any]]] = {}
            for system in systems:
                t1 = time.time()
                rnd[system] = run_system(system, size, timeout=1200)
                med = statistics.median(
                    max(ts) for ts in zip(*(x["times"] for x in rnd[system]), strict=True)
                )
                print(
                    f"{size_name} round {r + 1}/{size['rounds']} {system:>18}: median {med:.3f} s/step "
                    f"({time.time() - t1:.0f} s wall)",
                    flush=True,
                )
            rounds.append(rnd)
        summary = summarise(rounds, ref)
        doc["sizes"][size_name] = {
            "settings": {**size, "world_size": WORLD_SIZE, "backend": "gloo"},
            "num_parameters": rounds[0]["ddp"][0]["num_parameters"],
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)),
            "wall_s": time.time() - t0,
            "reference_losses": ref,
            "summary": summary,
            "raw": rounds,
        }
        import report

        print("\n" + report.table(doc["sizes"][size_name]), flush=True)
    doc["machine"] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "deepspeed_python": str(PEERS_PY) if use_ds else None,
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_")},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_path}")
    bad = [
        (s, k)
        for size in doc["sizes"].values()
        for s, row in size["summary"].items()
        for k, v in row.items()
        if isinstance(v, float) and not math.isfinite(v)
    ]
    if bad:
        raise SystemExit(f"non-finite figures: {bad}")
    if not args.quick and not args.no_docs:
        import report

        report.write_docs(doc)


if __name__ == "__main__":
    main()
