"""One training job at ZeRO stages 1, 2 and 3 in turn, as tests/test_multinode.py runs it on one or two
"nodes" (torchrun agents) of this machine.

Before anything else every rank checks what its launcher told it about its node: ``LOCAL_RANK`` in
``0..LOCAL_WORLD_SIZE-1`` (and equal to ``--local_rank`` when ``zeroshard launch`` passes it),
``LOCAL_WORLD_SIZE`` equal to ``--local-world-size``, ``GROUP_RANK`` (its agent's node rank) equal to
``--group-rank`` and ``RANK // LOCAL_WORLD_SIZE == GROUP_RANK`` (static rendezvous: the node ranks are the
ones given to the agents; ``--group-rank -1`` under c10d, which numbers the agents itself: only the
check below applies). Once the process group is up, rank 0 checks that the ranks' (node,
local rank) pairs cover every node exactly once per local rank and that the global ranks are numbered node by
node, under either rendezvous.

For each stage in ``--stages`` the job builds the same tiny model (seeded), trains it through the loader
``initialize(training_data=...)`` returns until ``--steps`` optimizer steps (the global batch is fixed, so
the accumulation steps follow the world size), after loading ``--resume``/stageN when given, saving into
``--save``/stageN after step ``--save-at`` when given. Rank 0 writes ``--out``/stageN.pt: the step it started
from, each step's loss averaged over the whole global batch (the same at every world size) and the final
parameters (``full_state_dict``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard.runtime.data import ResumableDataLoader

TRAIN_BATCH = 8
MICRO_BATCH = 2


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"rank {os.environ.get('RANK', '?')}: the launcher did not set {name}")
    return int(value)


def _check_node_variables(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(RANK, GROUP_RANK, LOCAL_RANK)`` once they agree with what this job was launched as."""
    rank, group = _env_int("RANK"), _env_int("GROUP_RANK")
    local, local_world = _env_int("LOCAL_RANK"), _env_int("LOCAL_WORLD_SIZE")
    problems = []
    if local_world != args.local_world_size:
        problems.append(f"LOCAL_WORLD_SIZE={local_world}, expected {args.local_world_size}")
    if not 0 <= local < local_world:
        problems.append(f"LOCAL_RANK={local} is not in 0..{local_world - 1}")
    if args.local_rank is not None and args.local_rank != local:
        problems.append(f"--local_rank={args.local_rank} but LOCAL_RANK={local}")
    if args.group_rank >= 0 and group != args.group_rank:
        problems.append(f"GROUP_RANK={group}, expected this agent's node rank {args.group_rank}")
    if args.group_rank >= 0 and rank // local_world != group:
        problems.append(f"RANK // LOCAL_WORLD_SIZE = {rank} // {local_world} != GROUP_RANK={group}")
    if problems:
        raise RuntimeError(f"rank {rank}: " + "; ".join(problems))
    return rank, group, local


def _check_nodes_cover_the_world(places: list[tuple[int, int, int]], local_world: int) -> None:
    """On rank 0: every node 0..nnodes-1 runs local ranks 0..LOCAL_WORLD_SIZE-1, each once, and the global
    ranks are numbered node by node (``RANK == GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``)."""
    pairs = sorted((group, local) for _, group, local in places)
    expected = [(g, lr) for g in range(len(places) // local_world) for lr in range(local_world)]
    numbered = all(r == i == g * local_world + lr for i, (r, g, lr) in enumerate(places))
    if len(places) % local_world or pairs != expected or not numbered:
        raise RuntimeError(f"rank 0: the ranks' (RANK, GROUP_RANK, LOCAL_RANK) are {sorted(places)}")


def _train_stage(stage: int, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 31), nn.Tanh(), nn.Linear(31, 3))  # 31: shards need padding
    data = TensorDataset(torch.randn(96, 16), torch.randn(96, 3))
    config = {
        "train_batch_size": TRAIN_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
    }
    engine, _, loader, _ = zeroshard.initialize(model=model, config=config, training_data=data)
    assert isinstance(loader, ResumableDataLoader)
    if args.resume:
        path, _ = engine.load_checkpoint(f"{args.resume}/stage{stage}")
        if path is None:
            raise RuntimeError(f"rank {engine.global_rank}: no checkpoint in {args.resume}/stage{stage}")
    result: dict[str, Any] = {"start": engine.global_steps, "losses": {}}
    micro_losses: list[torch.Tensor] = []
    epoch = loader.epoch  # where a loaded checkpoint left the data
    while engine.global_steps < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            micro_losses.append(loss.detach())
            before = engine.global_steps
            engine.step()
            if engine.global_steps == before:  # inside an accumulation window
                continue
            # The step's loss over the global batch: every rank's micro-batches, all of the same size.
            total = torch.stack(micro_losses).sum()
            dist.all_reduce(total)
            result["losses"][engine.global_steps] = (total / (TRAIN_BATCH // MICRO_BATCH)).item()
            micro_losses.clear()
            if args.save and engine.global_steps == args.save_at:
                engine.save_checkpoint(f"{args.save}/stage{stage}")
            if engine.global_steps >= args.steps:
                break
        epoch += 1
    result["params"] = engine.full_state_dict()  # collective at stage 3
    if engine.global_rank == 0:
        torch.save(result, Path(args.out) / f"stage{stage}.pt")
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save", default="")
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--resume", default="")
    parser.add_argument("--local-world-size", type=int, required=True)
    parser.add_argument("--group-rank", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # zeroshard launch passes it, torchrun not
    args = parser.parse_args()

    place = _check_node_variables(args)
    torch.set_num_threads(1)
    zeroshard.init_distributed()
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    if dist.get_rank() == 0:
        _check_nodes_cover_the_world(places, args.local_world_size)
    for stage in args.stages:
        _train_stage(stage, args)
    zeroshard.shutdown_distributed()


if __name__ == "__main__":
    main()
