"""Pieces shared by the benchmarks: environment, the GPT, synthetic data, RSS and the process pair.

Importing this module sets ``OMP_NUM_THREADS=1`` and ``MALLOC_MMAP_THRESHOLD_`` (before torch is imported) so
that every spawned child inherits them, and puts the repository and ``examples/`` on ``sys.path``. It imports
neither zeroshard nor DeepSpeed, so both the dev venv and the peers' venv can use it.
"""

from __future__ import annotations

import datetime
import os
import queue
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One intra-op thread per process: two ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# glibc would otherwise keep freed large blocks in its heap and peak RSS would measure the allocator; the
# same setting PEERS.md's RSS ratios were taken with.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

WORLD_SIZE = 2
LR = 1e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0


def ds_config(zero: dict[str, Any], micro_batch: int) -> dict[str, Any]:
    """The ds_config.json zeroshard is given (DeepSpeed's gets ``torch_adam`` added: no fused op on CPU)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }


def rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_gpt(model: dict[str, Any]) -> torch.nn.Module:
    """The demo GPT of ``examples/train_gpt.py``, seeded so that every rank and system starts identical."""
    from train_gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**model))


def tokens_for(rank: int, n_steps: int, micro_batch: int, model: dict[str, Any]) -> torch.Tensor:
    """Rank ``rank``'s synthetic tokens, shape (steps, micro_batch, block_size + 1)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(model["vocab_size"], (n_steps, micro_batch, model["block_size"] + 1), generator=g)


def _entry(rank: int, init_file: str, worker: Callable[..., Any], spec: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # join through the file rendezvous, not a launcher's env
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=300),
        )
        value = [worker(rank, s) for s in spec["runs"]]
        dist.barrier()  # leave together: a gloo group torn down under a peer can abort the exit
        results.put((rank, "ok", value))
    except BaseException as e:  # report to the parent instead of hanging it
        import traceback

        results.put((rank, "error", f"{e!r}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_pair(
    worker: Callable[[int, dict[str, Any]], Any], spec: dict[str, Any], timeout: float = 900
) -> list[list[Any]]:
    """Run ``worker(rank, run)`` for each of ``spec["runs"]`` on two spawned ranks; per rank, the results.

    ``worker`` must be a module-level function (it is pickled by reference into the spawned children).
    A failing rank's traceback is re-raised here, prefixed with its rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(r, init_file, worker, spec, results), daemon=True)
            for r in range(WORLD_SIZE)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < WORLD_SIZE:
                try:
                    rank, status, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{spec['name']}: timed out after {timeout} s") from None
                    if all(not p.is_alive() for p in procs) and results.empty():
                        raise RuntimeError(f"{spec['name']}: workers exited without a result") from None
                    continue
                if status != "ok":
                    raise RuntimeError(f"{spec['name']} rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(WORLD_SIZE)]
