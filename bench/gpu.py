"""One GPU: zeroshard's CUDA paths against a plain PyTorch loop (throughput, GPU memory, ZeRO-Offload).

    python bench/gpu.py                 # GPT of ~1.3B parameters, every row (needs a CUDA GPU)
    python bench/gpu.py --quick         # a small GPT, a smoke test
    python bench/gpu.py --rows torch,zero2_offload

Rows, each in a fresh process (so peak memory is its own), run one after another on the same GPU:

* ``torch``: the plain PyTorch recipe, no zeroshard: fp32 parameters, ``torch.autocast`` to bf16, fused AdamW.
* ``zeroN_bf16`` / ``zero2_fp16``: zeroshard at stage N, 16-bit parameters and gradients, fp32 masters
  (world size 1: every stage keeps the same bytes; the rows show what each stage's machinery costs).
* ``zero2_offload``: ZeRO-Offload, ``offload_optimizer.device: cpu``: masters and Adam's moments in pinned
  CPU memory, the step on the CPU (torch's fused CPU Adam); the GPU holds 16-bit parameters and gradients.
* ``zero3_offload``: stage 3 with the optimizer in CPU memory (the gathers read the pinned masters).

Per row: median step time (min, max) over the timed steps after warm-up, tokens/s, model TFLOP/s
(6 · N · tokens / time, attention not counted), peak GPU memory (``torch.cuda.max_memory_allocated``),
GPU bytes per parameter held between steps (``memory_allocated`` after a step, the batch not counted),
model-state bytes per parameter from ``memory_breakdown()`` (GPU and CPU together, bucket buffers
included) and the process's peak RSS. Raw results go to
``bench/results/gpu.json``; the table is printed as Markdown for ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

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
        "zero3_offload"]  # fmt: skip


def zero_config(row: str, micro_batch: int) -> dict[str, Any]:
    stage = int(row[4])
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if row.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=5e7, stage3_param_persistence_threshold=1e5)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
    }
    if row.endswith("fp16"):
        config["fp16"] = {"enabled": True, "initial_scale_power": 12}
    else:
        config["bf16"] = {"enabled": True}
    return config


def run_row(row: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: build, warm up, time. Returns the measurements."""
    from train_gpt import GPT, GPTConfig

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig(**spec["model"]))
    n_params = sum(p.numel() for p in model.parameters())
    b, t, vocab = spec["micro_batch"], spec["model"]["block_size"], spec["model"]["vocab_size"]
    data = torch.randint(vocab, (spec["warmup"] + spec["steps"], b, t + 1), device="cuda")
    extra: dict[str, Any] = {}
    if row == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

        def step(i: int) -> None:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(data[i, :, :-1], data[i, :, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        import zeroshard

        engine, _, _, _ = zeroshard.initialize(model=model, config=zero_config(row, b))
        extra["engine device"] = str(engine.device)

        def step(i: int) -> None:
            engine.backward(engine(data[i, :, :-1], data[i, :, 1:]))
            engine.step()

    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens = b * t
    out = {
        "row": row,
        "params": n_params,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "tokens_per_s": tokens / median,
        "model_tflops": 6 * n_params * tokens / median / 1e12,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "gpu_bytes_after_step": torch.cuda.memory_allocated() - data.numel() * data.element_size(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        **extra,
    }
    if row != "torch":
        mem = engine.memory_breakdown()
        out["model_state_bytes"] = mem.total
        out["model_state_bytes_per_param"] = mem.total / n_params
        out["breakdown"] = {k: v for k, v in vars(mem).items() if isinstance(v, int | float)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one row in this process
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = parser.parse_args()
    spec = QUICK if args.quick else FULL
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA GPU")
    if args.one:
        print("RESULT " + json.dumps(run_row(args.one, spec)), flush=True)
        return
    results = []
    for row in args.rows.split(","):
        cmd = [sys.executable, __file__, "--one", row] + (["--quick"] if args.quick else [])
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"{row}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            results.append({"row": row, "error": proc.stderr[-3000:]})
            continue
        results.append(json.loads(line[len("RESULT ") :]))
        print(f"{row}: done", flush=True)
    props = torch.cuda.get_device_properties(0)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": props.name, "torch": torch.__version__, "spec": spec, "results": results}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    sys.path.insert(0, str(ROOT / "tools"))
    import benchmark_tables

    print(benchmark_tables.gpu(lambda _: doc))


if __name__ == "__main__":
    main()
