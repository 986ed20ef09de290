"""A training job that resumes itself, as a user runs one under ``torchrun --max-restarts``.

Every start loads the newest checkpoint in ``--ckpt`` (none on the first), then trains through the loader
``initialize(training_data=...)`` returns until ``--steps`` optimizer steps, saving every ``--save-every``.
Rank 0 appends ``step loss`` lines to ``--out``, the step each start resumed from to ``--out``.starts,
and at the end writes the parameters to ``--out``.final.pt. One fault is injected, once per job (a marker
file beside ``--ckpt`` remembers it):

- ``--fault step:N``: rank ``--fault-rank`` is SIGKILLed after optimizer step N;
- ``--fault save:N:K``: rank ``--fault-rank`` is SIGKILLed inside the save after step N, right after its
  K-th ``os.fsync`` of that save (rank 0 makes 7 at world size 2: its shard, the metadata, the directories
  and ``latest``; every other rank 1, its shard);
- ``--fault agent:N``: after step N, the worker whose torchrun agent does not host the rendezvous store
  (``--rdzv-port``) SIGKILLs its agent, then itself (``--fault-rank`` is not used): the job goes on with the
  other agent's workers.

Used by tests/test_restarts.py.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zeroshard


def _die(marker: Path, pid: int | None = None) -> None:
    """Remember that the fault fired (once per job), then SIGKILL ``pid`` (if any) and this process."""
    marker.touch()
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _die_at_fsync(count: int, marker: Path) -> None:
    original = os.fsync
    calls = [0]

    def fsync_then_die(fd: Any) -> None:
        original(fd)
        calls[0] += 1
        if calls[0] == count:
            _die(marker)

    os.fsync = fsync_then_die


def _hosts_port(pid: int, port: int) -> bool:
    """Whether process ``pid`` listens on ``port`` (the torchrun agent hosting the rendezvous store)."""
    return any(
        c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
        for c in psutil.Process(pid).net_connections(kind="tcp")
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--fault", default="")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--rdzv-port", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    data = TensorDataset(torch.randn(96, 16), torch.randn(96, 4))
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 200},
    }
    engine, _, loader, _ = zeroshard.initialize(model=model, config=config, training_data=data)
    assert loader is not None
    engine.load_checkpoint(args.ckpt)  # nothing yet on the first start: (None, None)
    if engine.global_rank == 0:
        with open(args.out + ".starts", "a") as starts:
            starts.write(f"{engine.global_steps}\n")

    kind, _, when = args.fault.partition(":")
    marker = Path(args.ckpt + ".fault-done")
    if kind == "agent":
        armed = not marker.exists() and not _hosts_port(os.getppid(), args.rdzv_port)
    else:
        armed = bool(kind) and not marker.exists() and engine.global_rank == args.fault_rank
    at_step = int(when.split(":")[0]) if kind else -1
    rank0 = engine.global_rank == 0
    epoch = loader.epoch  # where the checkpoint left the data ([Note: data position])
    while engine.global_steps < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            if engine.global_steps == before:  # inside an accumulation window
                continue
            step = engine.global_steps
            if rank0:
                with open(args.out, "a") as out:
                    out.write(f"{step} {loss.item():.17g}\n")
            if armed and step == at_step and kind in ("step", "agent"):
                _die(marker, os.getppid() if kind == "agent" else None)
            if step % args.save_every == 0:
                if armed and step == at_step and kind == "save":
                    _die_at_fsync(int(when.split(":")[1]), marker)
                engine.save_checkpoint(args.ckpt)
            if step >= args.steps:
                break
        epoch += 1
    state = engine.full_state_dict()  # collective at stage 3
    if rank0:
        torch.save(state, args.out + ".final.pt")
    zeroshard.shutdown_distributed()


if __name__ == "__main__":
    main()
