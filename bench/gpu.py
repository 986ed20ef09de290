"""One GPU: zeroshard's CUDA paths against a plain PyTorch loop (throughput, GPU memory, ZeRO-Offload and
ZeRO-Infinity in CPU memory), optionally the same rows under DeepSpeed. The largest GPT each offload setting
trains on this GPU and host is bench/gpu_largest.py.

    python bench/gpu.py                 # GPT of ~1.3B parameters, every row (needs a CUDA GPU)
    python bench/gpu.py --quick         # a small GPT, a smoke test
    python bench/gpu.py --rows torch,zero2_offload --time-limit-s 120
    python bench/gpu.py --deepspeed     # every zeroshard row, then the same row under DeepSpeed (ds_<row>)
    python bench/gpu.py --quick --device cpu [--deepspeed]   # check it, no GPU

``--device cpu`` (with ``--quick``) runs every path of the script on a machine without a GPU: the rows and the
DeepSpeed rows (``DS_ACCELERATOR=cpu``; fp16 is refused there). Its figures mean nothing.

Rows, each in a fresh process (so peak memory is its own), run one after another on the same GPU:

* ``torch``: the plain PyTorch recipe, no zeroshard: fp32 parameters, ``torch.autocast`` to bf16, fused AdamW.
* ``zeroN_bf16`` / ``zero2_fp16``: zeroshard at stage N, 16-bit parameters and gradients, fp32 masters
  (world size 1: every stage keeps the same bytes; the rows show what each stage's machinery costs).
* ``zero2_offload``: ZeRO-Offload, ``offload_optimizer.device: cpu``: masters and Adam's moments in pinned
  CPU memory, the step on the CPU (torch's fused CPU Adam); the GPU holds 16-bit parameters and gradients.
* ``zero3_offload``: stage 3 with the optimizer in CPU memory.
* ``zero3_offload_param``: stage 3 with ``offload_param.device: cpu``: each unit's 16-bit shard in pinned CPU
  memory, copied to the GPU ahead of its gather; masters and Adam's moments stay on the GPU.
* ``zero3_offload_all``: both: the CPU step writes the new 16-bit values into the pinned shards.
  The two ``offload_param`` rows build the model under ``zero.Init(remote_device="cpu", dtype=bf16)``: its
  partitions in CPU memory, never whole on the GPU. The other rows build it on the GPU.
* ``ds_<row>`` (``--deepspeed``, or named in ``--rows``): the zeroshard row's config under DeepSpeed, in a
  child without ``ZEROSHARD_AS_DEEPSPEED`` (so ``import deepspeed`` is the real package), its ``zero.Init``
  for the ``offload_param`` rows. Without ``offload_optimizer`` DeepSpeed steps with torch's fused AdamW
  (``torch_adam``: the kernel zeroshard runs, and no CUDA op to compile), with it with DeepSpeedCPUAdam,
  JIT-built on first use (``TORCH_CUDA_ARCH_LIST`` is set to 9.0 for the child unless set). A row whose
  child fails (DeepSpeed not installed included) is recorded with its error.

Per row: median step time (min, max) over the timed steps after warm-up, tokens/s, model TFLOP/s
(6 · N · tokens / time, attention not counted), peak GPU memory (``torch.cuda.max_memory_allocated``),
GPU bytes per parameter held between steps (``memory_allocated`` after a step, the batch not counted),
model-state bytes per parameter from ``memory_breakdown()`` (GPU and CPU together, bucket buffers
included), the process's peak RSS, and ``breakdown_s``: the seconds per timed step of each phase that
``engine.step_breakdown()`` reports, where the engine has that method and reports any. ``--time-limit-s``
bounds the rows' wall time: a row still running then is stopped, later rows are recorded as not run. Raw
results go to ``bench/results/gpu.json``; the table is printed as Markdown for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from gpu_common import DS, child_env, numel, on_sigterm, peak_rss, run_child, sync, write_results, zero_config
from torch import nn

FULL = {
    "model": {"vocab_size": 32768, "block_size": 1024, "n_layer": 24, "n_head": 16, "n_embd": 2048},
    "micro_batch": 8,
    "warmup": 3,
    "steps": 10,
}
QUICK = {
    "model": {"vocab_size": 1024, "block_size": 128, "n_layer": 2, "n_head": 4, "n_embd": 128},
    "micro_batch": 4,
    "warmup": 1,
    "steps": 3,
}
ROWS = ["torch", "zero0_bf16", "zero1_bf16", "zero2_bf16", "zero3_bf16", "zero2_fp16", "zero2_offload",
        "zero3_offload", "zero3_offload_param", "zero3_offload_all"]  # fmt: skip


def _library(row: str) -> Any:
    """zeroshard, or for ``ds_`` rows the real DeepSpeed with its process group up (the parent set
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ... for world size 1)."""
    if not row.startswith(DS):
        import zeroshard

        return zeroshard
    import deepspeed

    if "zeroshard" in str(deepspeed.__file__):
        raise RuntimeError(f"import deepspeed gave {deepspeed.__file__}, not the real DeepSpeed")
    deepspeed.init_distributed()
    return deepspeed


def build_model(lib: Any, config: dict[str, Any], model: dict[str, Any], device: str) -> nn.Module:
    """The GPT, seeded: with ``offload_param`` partitioned in CPU memory by ``lib.zero.Init`` (bf16), else
    whole on ``device``."""
    from train_gpt import GPT, GPTConfig

    torch.manual_seed(0)
    if "offload_param" in config["zero_optimization"]:
        init = lib.zero.Init(
            remote_device=config["zero_optimization"]["offload_param"]["device"],
            config_dict_or_path=copy.deepcopy(config),
            dtype=torch.bfloat16,
        )
        with init:
            return GPT(GPTConfig(**model))
    with torch.device(device):
        return GPT(GPTConfig(**model))


def run_row(row: str, spec: dict[str, Any], device: str) -> dict[str, Any]:
    """One row, in this process: build, warm up, time. Returns the measurements."""
    b, t, vocab = spec["micro_batch"], spec["model"]["block_size"], spec["model"]["vocab_size"]
    extra: dict[str, Any] = {}
    engine: Any = None
    if row == "torch":
        from train_gpt import GPT, GPTConfig

        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(GPTConfig(**spec["model"]))
        n_params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    else:
        lib = _library(row)
        config = zero_config(row, b)
        model = build_model(lib, config, spec["model"], device)
        n_params = sum(numel(p) for p in model.parameters())
        engine, _, _, _ = lib.initialize(model=model, config=config)
        extra["engine device"] = str(engine.device)
        if row.startswith(DS):
            extra["deepspeed"] = lib.__version__
    data = torch.randint(vocab, (spec["warmup"] + spec["steps"], b, t + 1), device=device)

    def step(i: int) -> None:
        if engine is not None:
            engine.backward(engine(data[i, :, :-1], data[i, :, 1:]))
            engine.step()
            return
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(data[i, :, :-1], data[i, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    breakdown: Callable[[], dict[str, float]] | None = getattr(engine, "step_breakdown", None)
    times: list[float] = []
    phases: dict[str, float] = {}
    for i in range(spec["warmup"] + spec["steps"]):
        sync(device)
        start = time.perf_counter()
        step(i)
        sync(device)
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
            for key, seconds in (breakdown() if breakdown is not None else {}).items():
                phases[key] = phases.get(key, 0.0) + float(seconds)
    median = statistics.median(times)
    tokens = b * t
    cuda = device == "cuda"
    out = {
        "row": row,
        "params": n_params,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "tokens_per_s": tokens / median,
        "model_tflops": 6 * n_params * tokens / median / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "gpu_bytes_after_step": (torch.cuda.memory_allocated() - data.numel() * data.element_size())
        if cuda
        else 0,
        "peak_rss_bytes": peak_rss(),
        **extra,
    }
    if phases:  # seconds per timed step (a phase missing from a step counts 0 there)
        out["breakdown_s"] = {key: seconds / len(times) for key, seconds in phases.items()}
    if engine is not None and not row.startswith(DS):  # DeepSpeed's memory_breakdown() is a config flag
        mem = engine.memory_breakdown()
        out["model_state_bytes"] = mem.total
        out["model_state_bytes_per_param"] = mem.total / n_params
        out["breakdown"] = {k: v for k, v in vars(mem).items() if isinstance(v, int | float)}
    return out


def run_rows(rows: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each row in a child, within ``--time-limit-s``; failures are recorded, not raised."""
    start = time.monotonic()
    results: list[dict[str, Any]] = []
    for row in rows:
        left = None if args.time_limit_s is None else args.time_limit_s - (time.monotonic() - start)
        if left is not None and left <= 0:
            print(f"{row}: not run (--time-limit-s {args.time_limit_s:g} reached)", flush=True)
            results.append({"row": row, "skipped": f"--time-limit-s {args.time_limit_s:g} reached"})
            continue
        cmd = [sys.executable, __file__, "--one", row, "--device", args.device]
        cmd += ["--quick"] if args.quick else []
        child = run_child(cmd, child_env(row, args.device), left)
        line = child.line("RESULT")
        if line is None and child.stopped:
            print(f"{row}: stopped at --time-limit-s {args.time_limit_s:g}", flush=True)
            results.append({"row": row, "skipped": f"stopped at --time-limit-s {args.time_limit_s:g}"})
            continue
        if line is None:
            print(f"{row}: failed (rc {child.returncode})\n{child.tail()}", flush=True)
            results.append({"row": row, "error": f"rc {child.returncode}: {child.tail()}"})
            continue
        result = json.loads(line)
        if child.returncode != 0:  # measured, then failed on its way out: the figures stand
            result["exit_code"] = child.returncode
        results.append(result)
        print(f"{row}: done ({child.wall_s:.0f} s)", flush=True)
    return results


# -- entry point ------------------------------------------------------------------------------------------


def _rows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    rows = [r for r in args.rows.split(",") if r]
    for row in rows:
        if row.removeprefix(DS) not in ROWS or row == DS + "torch":
            parser.error(f"--rows: unknown row {row!r}; rows: {', '.join(ROWS)} and ds_<row> but ds_torch")
    if args.deepspeed:
        rows = [x for r in rows for x in ([r] if r == "torch" or r.startswith(DS) else [r, DS + r])]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small GPTs: a smoke test")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows, in the order to run")
    parser.add_argument("--deepspeed", action="store_true", help="after each zeroshard row, ds_<row>")
    parser.add_argument("--time-limit-s", type=float, help="stop the rows after this many seconds")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cpu (with --quick): check the script here"
    )
    parser.add_argument("--out", help="results file (default bench/results/gpu.json)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one row in this process
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU (--device cpu --quick checks the script without one)")
    if args.device == "cpu" and not args.quick:
        parser.error("--device cpu needs --quick (a 1.3B GPT on a CPU would take hours)")
    signal.signal(signal.SIGTERM, on_sigterm)
    spec = QUICK if args.quick else FULL
    if args.one:
        result = run_row(args.one, spec, args.device)
        print("RESULT " + json.dumps(result), flush=True)
        if args.one.startswith(DS):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()  # DeepSpeed leaves it up, and torch may then abort at exit
        return
    results = run_rows(_rows(args, parser), args)
    device = torch.cuda.get_device_properties(0).name if args.device == "cuda" else "CPU (--device cpu)"
    write_results(
        "gpu", args.out, {"device": device, "torch": torch.__version__, "spec": spec, "results": results}
    )


if __name__ == "__main__":
    main()
