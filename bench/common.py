"""Pieces shared by the benchmarks: environment, the GPT, synthetic data, RSS and the process pair.

Importing this module sets ``OMP_NUM_THREADS=1`` and ``MALLOC_MMAP_THRESHOLD_`` (before torch is imported; not
with ``ZEROSHARD_BENCH_GLIBC_DEFAULTS=1``) so that every spawned child inherits them, and puts the repository
and ``examples/`` on ``sys.path``. It imports neither zeroshard nor DeepSpeed, so both the dev venv and the
peers' venv can use it.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# One intra-op thread per process: two ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# glibc would otherwise keep freed large blocks in its heap and peak RSS would measure the allocator; the
# same setting PEERS.md's RSS ratios were taken with. ZEROSHARD_BENCH_GLIBC_DEFAULTS=1 leaves glibc's own
# (dynamic) threshold, to show what the allocator holds (docs/benchmarks.md, memory by stage).
if os.environ.get("ZEROSHARD_BENCH_GLIBC_DEFAULTS") != "1":
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Ranks per run: two (one per core) unless ZEROSHARD_BENCH_WORLD_SIZE says otherwise; ranks
# inherit it.
WORLD_SIZE = int(os.environ.get("ZEROSHARD_BENCH_WORLD_SIZE", "2"))
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
    """This process's peak resident set size in bytes since it started its program (``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss``: Linux carries that across ``exec`` from the process that forked, so a
    rank started by a parent holding 500 MB reported at least 500 MB whatever it did itself.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_gpt(model: dict[str, Any]) -> torch.nn.Module:
    """The demo GPT of ``examples/train_gpt.py``, seeded so that every rank and system starts identical."""
    from train_gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**model))


def tokens_for(
    rank: int, n_steps: int, micro_batch: int, model: dict[str, Any], seq_len: int | None = None
) -> torch.Tensor:
    """Rank ``rank``'s synthetic tokens, shape (steps, micro_batch, seq_len + 1).

    ``seq_len`` defaults to the model's ``block_size``; a shorter one keeps the model (and its parameter
    count) and feeds fewer tokens per step.
    """
    seq_len = model["block_size"] if seq_len is None else seq_len
    if not 0 < seq_len <= model["block_size"]:
        raise ValueError(f"seq_len({seq_len}) must be in 1..block_size({model['block_size']})")
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(model["vocab_size"], (n_steps, micro_batch, seq_len + 1), generator=g)


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


def join_group(rank: int, init_file: str) -> None:
    """Join the ``WORLD_SIZE``-rank gloo group through the ``file://`` rendezvous ``init_file``, one thread
    per rank."""
    torch.set_num_threads(1)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # join through the file rendezvous, not a launcher's env
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=300),
    )


def _entry(rank: int, init_file: str, worker: Callable[..., Any], spec: dict[str, Any], results: Any) -> None:
    try:
        join_group(rank, init_file)
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
    """Run ``worker(rank, run)`` for each of ``spec["runs"]`` on ``WORLD_SIZE`` spawned ranks; per rank, the
    results.

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


def rank_main(worker: Callable[[int, dict[str, Any]], Any], rank: int, spec_file: str, out_file: str) -> None:
    """One rank of :func:`run_ranks`: join the group, run ``worker(rank, run)`` per run, write the results.

    Collective: every rank runs it. The rendezvous file lies beside ``spec_file``.
    """
    spec = json.loads(Path(spec_file).read_text())
    join_group(rank, str(Path(spec_file).parent / "rendezvous"))
    try:
        value = [worker(rank, run) for run in spec["runs"]]
        dist.barrier()  # leave together: a gloo group torn down under a peer can abort the exit
        Path(out_file).write_text(json.dumps(value))
    finally:
        dist.destroy_process_group()


def run_ranks(
    python: str, script: str, spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None
) -> list[list[Any]]:
    """Run ``python script --rank R SPEC OUT`` for every rank; per rank, the results ``rank_main`` wrote.

    One fresh interpreter per rank, started straight from this process: no launcher interpreter and no
    ``spawn`` in between, so a run costs one interpreter start-up, and either venv's interpreter can be used.
    A rank that fails takes the other down at once (it would otherwise wait in a collective until the group's
    timeout) and the tail of its output is raised here, prefixed with its rank; so is a run past ``timeout``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp, "spec.json")
        spec_file.write_text(json.dumps(spec))
        logs = [open(Path(tmp, f"rank{r}.log"), "w+") for r in range(WORLD_SIZE)]
        outs = [Path(tmp, f"out{r}.json") for r in range(WORLD_SIZE)]
        procs = [
            subprocess.Popen(
                [python, script, "--rank", str(r), str(spec_file), str(outs[r])],
                env=env,
                stdout=logs[r],
                stderr=subprocess.STDOUT,
            )
            for r in range(WORLD_SIZE)
        ]
        deadline = time.monotonic() + timeout
        failed: tuple[int, str] | None = None  # (rank whose output to show, what happened)
        try:
            while failed is None:
                codes = [p.poll() for p in procs]
                bad = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                if bad is not None:
                    failed = (bad, f"rank {bad} exited with {codes[bad]}")
                elif all(c == 0 for c in codes):
                    break
                elif time.monotonic() > deadline:
                    failed = (0, f"timed out after {timeout:.0f} s")
                else:
                    time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            tails = []
            for log in logs:
                log.seek(0)
                tails.append(log.read()[-4000:])
                log.close()
        if failed is not None:
            rank, what = failed
            raise RuntimeError(f"{spec['name']}: {what}; rank {rank}'s output ends:\n{tails[rank]}")
        return [json.loads(o.read_text()) for o in outs]
