"""Start gloo (on a GPU, NCCL) worker processes for a test, with a timeout and the failing rank's traceback.

Rendezvous is a ``file://`` in a fresh temporary directory (no ports, so no port races). Each worker gets
``(rank, world_size, *args)``; whatever it returns comes back to the test, in rank order.

Workers are forked from a ``forkserver`` that imported torch and zeroshard once (``PRELOAD``), not spawned
as fresh interpreters: a spawned worker spends ~3 CPU-seconds importing them, which was most of the cost of
many distributed tests. Nothing else is inherited: the forkserver starts no thread and touches no device
before it forks, each worker gets the test's current environment, and ``sys.path`` and the main module are
prepared as for ``spawn``.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroshard.dist import shutdown_distributed

PRELOAD = ["torch", "torch.distributed", "zeroshard", "tests.distributed", "tests.models"]


def _context() -> Any:
    """The forkserver context, with ``PRELOAD`` imported in the server (``spawn`` where there is none)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts, on the first test
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple[Any, ...],
    results: Any,
    collective_timeout: float,
    backend: str,
    env: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the test's environment now, not the forkserver's when it started
    torch.set_num_threads(1)
    os.environ.pop("WORLD_SIZE", None)  # workers join through the file rendezvous, not torchrun's env
    os.environ["ZEROSHARD_COLLECTIVE_TIMEOUT_S"] = str(collective_timeout)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        value = fn(rank, world_size, *args)
        try:
            shutdown_distributed()  # barrier first: a gloo group torn down under a peer can abort the exit
        except RuntimeError:
            pass  # a peer is gone (a test may kill one on purpose); its own report says why
        results.put((rank, "ok", value))
    except BaseException:
        tb = traceback.format_exc()
        sys.stderr.write(f"[rank {rank}] {tb}")
        results.put((rank, "error", tb))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    collective_timeout: float = 60,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return their results.

    ``collective_timeout`` is the process group's timeout: a collective that cannot complete raises then.
    ``backend="nccl"`` gives rank r the GPU r (one GPU per rank, as NCCL requires).

    Raises AssertionError carrying the first failing rank's traceback, prefixed with its rank, or naming the
    ranks still running when ``timeout`` seconds have passed (they are killed).
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_entry,
                args=(
                    fn,
                    r,
                    world_size,
                    init_file,
                    args,
                    results,
                    collective_timeout,
                    backend,
                    dict(os.environ),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[tuple[int, str]] = []
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    # Every worker exited: take what is still in the pipe; a rank that crashed before
                    # reporting shows as missing.
                    try:
                        while True:
                            rank, status, value = results.get(timeout=2)
                            (out.__setitem__(rank, value) if status == "ok" else errors.append((rank, value)))
                    except queue.Empty:
                        break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append((rank, value))
                deadline = min(deadline, time.monotonic() + 15)  # the others fail soon (timeouts)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        # A crash on one rank shows up on the others as a broken connection: put the cause first.
        def secondary(tb: str) -> bool:
            return "Connection reset by peer" in tb or "Connection closed by peer" in tb

        errors.sort(key=lambda e: (secondary(e[1]), e[0]))
        parts = ["".join(f"[rank {rank}] {line}\n" for line in tb.splitlines()) for rank, tb in errors]
        raise AssertionError(f"rank {errors[0][0]} of {world_size} failed:\n" + "\n".join(parts))
    if len(out) < world_size:
        missing = sorted(set(range(world_size)) - set(out))
        codes = {r: procs[r].exitcode for r in missing}
        raise AssertionError(
            f"ranks {missing} of {world_size} did not report within {timeout:.0f}s (exit codes {codes}; "
            "None means still running when killed)"
        )
    return [out[r] for r in range(world_size)]
