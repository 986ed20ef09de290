"""The data position of ``initialize(training_data=...)``'s loader: saved, restored, resharded.

Unit tests drive loaders for every rank of a world size in one process (DistributedSampler takes the
rank and world size as arguments): resuming at 1, 2, 3, 4 and 6 ranks continues the saved permutation
exactly. The engine test checks the checkpoint end to end: at world size 2 a run interrupted by a
checkpoint and resumed in fresh engines sees the same samples and computes the same losses and
parameters, bit for bit, as an uninterrupted run; resumed from world size 2 at 1 and from 1 at 2, every
rank sees exactly the samples the permutation holds next, each step trains on the uninterrupted run's
global batch, and the parameters match it within test_parity's bound.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import zeroshard
from tests.distributed import run_distributed
from tests.models import VOCAB, make_model, two_groups
from tests.test_checkpoint import assert_equal_params, config, params, portable, unportable, worst_error
from zeroshard.runtime.data import ResumableDataLoader, build_loader


class Indexed(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``(i, x_i, y_i)``: fixed random tokens, so a run's losses depend on which samples
    it sees; about one sample in six starts with token 0 (the toy model's `rare` layer)."""

    def __init__(self, n: int, seq: int = 5) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randint(1, VOCAB, (n, seq), generator=g)
        self.y = torch.randint(0, VOCAB, (n, seq), generator=g)
        self.x[::6, 0] = 0

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


class Numbers(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def order(n: int, epoch: int, world_size: int, seed: int = 0) -> list[int]:
    """DistributedSampler's epoch order, written out independently: the seeded permutation, padded with
    its own head to a multiple of the world size. Rank r's share is ``order(...)[r::world_size]``."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = -(-n // world_size) * world_size
    return (perm * (total // n + 1))[:total]


def loaders(n: int, world_size: int, batch: int, drop_last: bool = False) -> list[ResumableDataLoader]:
    return [
        build_loader(Numbers(n), rank=r, world_size=world_size, micro_batch_size=batch, drop_last=drop_last)
        for r in range(world_size)
    ]


def take(loader: ResumableDataLoader, batches: int) -> list[int]:
    """The samples of the next ``batches`` batches of a pass (a pass left part-way, as a run stops)."""
    out: list[int] = []
    for i, b in enumerate(loader):
        out += b.tolist()
        if i + 1 == batches:
            break
    return out


def rest(loader: ResumableDataLoader) -> list[int]:
    return [i for b in loader for i in b.tolist()]


# -- unit tests: no processes ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [48, 50])  # 50: DistributedSampler pads at world sizes 3 and 4
def test_resume_at_any_world_size_continues_the_permutation(n: int) -> None:
    for new_size in (1, 2, 3, 4, 6):
        saving = loaders(n, 2, batch=3)
        for loader in saving:
            loader.set_epoch(1)
        seen = [take(loader, 4) for loader in saving]  # 4 batches of 3 on each of 2 ranks
        assert seen == [order(n, 1, 2)[r::2][:12] for r in range(2)]
        state = json.loads(json.dumps(saving[0].state_dict()))  # it is stored as JSON
        assert state == {
            "epoch": 1,
            "consumed_samples": 24,
            "seed": 0,
            "shuffle": True,
            "dataset_length": n,
            "world_size": 2,
        }
        resumed = loaders(n, new_size, batch=5)
        for loader in resumed:
            loader.load_state_dict(state)
            assert loader.epoch == 1
            loader.set_epoch(loader.epoch)  # the demo's loop: the current epoch keeps its position
        full = order(n, 1, new_size)
        for r, loader in enumerate(resumed):
            expected = full[r::new_size][24 // new_size :]
            assert len(loader) == -(-len(expected) // 5), f"W={new_size} rank {r}: len() of the pass"
            assert rest(loader) == expected, f"W={new_size} rank {r}"
            assert loader.state_dict()["consumed_samples"] == len(full)
        # Every sample of the epoch exactly once (24 is a multiple of every new world size here).
        if n % new_size == 0:
            after = [i for r in range(new_size) for i in full[r::new_size][24 // new_size :]]
            assert sorted(after + [i for s in seen for i in s]) == list(range(n))
        # A second pass of the same epoch starts at its beginning, as DistributedSampler's does.
        assert rest(resumed[0]) == full[0::new_size]


def test_position_across_epochs_and_passes() -> None:
    (loader,) = loaders(10, 1, batch=4)
    assert loader.state_dict()["consumed_samples"] == 0
    assert rest(loader) == order(10, 0, 1)
    assert loader.state_dict()["consumed_samples"] == 10  # the epoch is done: a resumed pass is empty
    done = loader.state_dict()
    loader.set_epoch(0)  # the same epoch: nothing changes
    assert loader.state_dict() == done
    loader.set_epoch(1)
    assert loader.state_dict()["consumed_samples"] == 0 and loader.epoch == 1
    assert take(loader, 1) == order(10, 1, 1)[:4]
    assert loader.state_dict()["consumed_samples"] == 4

    (finished,) = loaders(10, 1, batch=4)
    finished.load_state_dict(done)
    assert len(finished) == 0 and rest(finished) == []
    finished.set_epoch(finished.epoch + 1)
    assert rest(finished) == order(10, 1, 1)

    # An epoch finished at world size 2 (positions 0-9 of 10) is finished at 4 too, though 4 does not
    # divide 10: no padded sample is handed out again.
    done2 = loaders(10, 2, batch=5)
    for loader in done2:
        rest(loader)
    for loader in loaders(10, 4, batch=2):
        loader.load_state_dict(done2[0].state_dict())
        assert rest(loader) == []


def test_uneven_resume_rounds_down_and_warns(caplog: Any) -> None:
    saving = loaders(40, 2, batch=3)
    for loader in saving:
        take(loader, 1)
    state = saving[0].state_dict()
    assert state["consumed_samples"] == 6
    with caplog.at_level(logging.WARNING, logger="zeroshard.runtime.data"):
        resumed = loaders(40, 4, batch=3)
        for loader in resumed:
            loader.load_state_dict(state)
    assert "the last 2 samples before the checkpoint are seen again" in caplog.text
    full = order(40, 0, 4)
    assert [rest(loader) for loader in resumed] == [full[r::4][1:] for r in range(4)]  # from position 4


def test_seed_and_shuffle_restored_other_dataset_ignored(caplog: Any) -> None:
    (saving,) = loaders(20, 1, batch=4)
    saving.position.seed, saving.position.shuffle = 7, False
    take(saving, 2)
    (resumed,) = loaders(20, 1, batch=4)
    resumed.load_state_dict(saving.state_dict())
    assert rest(resumed) == list(range(8, 20))

    (other,) = loaders(21, 1, batch=4)
    with caplog.at_level(logging.WARNING, logger="zeroshard.runtime.data"):
        other.load_state_dict(saving.state_dict())
    assert "saved over a dataset of 20 samples, this one has 21" in caplog.text
    assert other.state_dict()["consumed_samples"] == 0 and rest(other) == order(21, 0, 1)

    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"epoch": 0})


def test_set_epoch_to_another_epoch_drops_a_resumed_position(caplog: Any) -> None:
    (saving,) = loaders(20, 1, batch=4)
    saving.set_epoch(3)
    take(saving, 1)
    (resumed,) = loaders(20, 1, batch=4)
    resumed.load_state_dict(saving.state_dict())
    with caplog.at_level(logging.WARNING, logger="zeroshard.runtime.data"):
        resumed.sampler.set_epoch(0)  # a script whose epoch counter restarts at 0
    assert "set_epoch(0) drops the data position resumed in epoch 3" in caplog.text
    assert rest(resumed) == order(20, 0, 1)


def test_drop_last_counts_only_full_batches() -> None:
    saving = loaders(22, 2, batch=4, drop_last=True)  # 11 per rank: batches of 4, 4; 3 dropped
    assert [len(rest(loader)) for loader in saving] == [8, 8]
    assert saving[0].state_dict()["consumed_samples"] == 16
    (resumed,) = loaders(22, 1, batch=4, drop_last=True)
    resumed.load_state_dict(saving[0].state_dict())
    # Positions 16-21 were each rank's dropped remainder at world size 2; at world size 1 they are one
    # batch of 4 and a dropped 2.
    assert rest(resumed) == order(22, 0, 1)[16:20]


# -- engines ------------------------------------------------------------------------------------------------

SAMPLES = 60  # 5 optimizer steps of 12 samples per epoch
STEPS = 8  # crosses into the second epoch
Record = tuple[int, list[int], float]  # (optimizer step, the micro-batch's sample indices, its loss)
# (dataset size, accumulation steps, micro-steps before the save) at world size 2, 12 samples per step:
# after step 3; at the end of the first epoch (step 5); one micro-step into step 4's window; and two
# micro-steps into step 6's window, which began in the first epoch (64 samples: 16 micro-batches of 2 per
# rank and epoch, 3 per window), so the saved position lies back in epoch 0.
INTERRUPTIONS = [(60, 2, 6), (60, 2, 10), (60, 2, 7), (64, 3, 17)]


def build(
    stage: int, world_size: int, gas: int, seed: int = 0, samples: int = SAMPLES
) -> tuple[zeroshard.ZeroshardEngine, ResumableDataLoader]:
    model = make_model(seed)
    engine, _, loader, _ = zeroshard.initialize(
        model=model,
        model_parameters=two_groups(model),
        config=config(stage, world_size, gas),
        training_data=Indexed(samples),
    )
    assert isinstance(loader, ResumableDataLoader) and engine.training_dataloader is loader
    return engine, loader


def train(engine: zeroshard.ZeroshardEngine, loader: ResumableDataLoader, micro_steps: int) -> list[Record]:
    """examples/train_gpt.py's loop, epochs counted from the loader's, up to ``micro_steps`` micro-steps in
    all; one record per micro-step."""
    log: list[Record] = []
    epoch = loader.epoch
    while engine.micro_steps < micro_steps:
        loader.set_epoch(epoch)
        for idx, x, y in loader:
            step = engine.global_steps + 1  # the optimizer step this micro-batch counts towards
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            log.append((step, idx.tolist(), float(loss.detach())))
            if engine.micro_steps >= micro_steps:
                break
        epoch += 1
    return log


def same_w_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """At world size 2: uninterrupted runs vs runs saved part-way (see INTERRUPTIONS) and resumed."""
    refs: dict[tuple[int, int], tuple[list[Record], dict[str, torch.Tensor]]] = {}
    for samples, gas in dict.fromkeys((n, g) for n, g, _ in INTERRUPTIONS):
        ref, ref_loader = build(2, world_size, gas, samples=samples)
        refs[samples, gas] = train(ref, ref_loader, STEPS * gas), params(ref)
    for samples, gas, stop in INTERRUPTIONS:
        what = f"{samples} samples, saved after micro-step {stop} of {gas} per step"
        ref_log, ref_params = refs[samples, gas]
        engine, loader = build(2, world_size, gas, samples=samples)
        assert train(engine, loader, stop) == ref_log[:stop]
        ckpt = os.path.join(root, f"w2-{samples}-{stop}")
        engine.save_checkpoint(ckpt)
        fresh, fresh_loader = build(2, world_size, gas, samples=samples, seed=1)
        fresh.load_checkpoint(ckpt)
        restart = stop // gas * gas  # the first micro-step of the window the save interrupted
        after = train(fresh, fresh_loader, STEPS * gas)
        assert after == ref_log[restart:], f"{what}: other samples or losses after the resume"
        assert_equal_params(params(fresh), ref_params, what)
    if rank == 0:
        positions = {}
        for name in ("w2-60-6", "w2-64-17"):
            with open(os.path.join(root, name, "latest"), encoding="utf-8") as f:
                tag = f.read()
            with open(os.path.join(root, name, tag, "metadata.json"), encoding="utf-8") as f:
                positions[name] = json.load(f)["data"]
        assert positions["w2-60-6"] == {
            "epoch": 0,
            "consumed_samples": 36,
            "seed": 0,
            "shuffle": True,
            "dataset_length": SAMPLES,
            "world_size": 2,
        }
        # Step 6's window began with epoch 0's last micro-batch: 15 of 16 micro-batches of 2 per rank.
        assert (positions["w2-64-17"]["epoch"], positions["w2-64-17"]["consumed_samples"]) == (0, 60)
    ref_log, ref_params = refs[SAMPLES, 2]
    return {"log": ref_log, "params": ref_params}


def resumed(stage: int, world_size: int, gas: int, source: str) -> dict[str, Any]:
    """Load the checkpoint saved after step 3 at another world size and train to the end."""
    engine, loader = build(stage, world_size, gas, seed=1)
    engine.load_checkpoint(source)
    assert loader.epoch == 0 and loader.state_dict()["consumed_samples"] == 36
    return {"log": train(engine, loader, STEPS * gas), "params": params(engine)}


def data_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return portable(  # type: ignore[no-any-return]
        {
            "w2": same_w_worker(rank, world_size, root),
            "w1->w2": resumed(1, world_size, 2, os.path.join(root, "w1")),  # stage 0 -> 1 as well
        }
    )


def check_resumed(per_rank: list[list[Record]], ref: list[list[Record]], world_size: int) -> None:
    """Each rank sees the permutation's next samples; each step trains on the uninterrupted run's."""
    perms = [order(SAMPLES, e, world_size) for e in (0, 1)]
    for r, log in enumerate(per_rank):
        seen = [i for _, idx, _ in log for i in idx]
        expected = perms[0][r::world_size][36 // world_size :] + perms[1][r::world_size]
        assert seen == expected[: len(seen)], f"W={world_size} rank {r}"
        assert len(seen) == (STEPS - 3) * 12 // world_size
    for step in range(4, STEPS + 1):
        got = sorted(i for log in per_rank for s, idx, _ in log if s == step for i in idx)
        want = sorted(i for log in ref for s, idx, _ in log if s == step for i in idx)
        assert got == want, f"W={world_size} step {step}"


@pytest.fixture
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_engine_resumes_its_data_at_world_sizes_2_and_1(tmp_path: Any, one_thread: None) -> None:
    """2 -> 2 exactly, 1 -> 2 and 2 -> 1 with the exact samples per rank. Resharding the position to 3, 4
    and 6 ranks is the loader's arithmetic, tested above."""
    root = str(tmp_path)
    engine, loader = build(0, 1, gas=3)  # W=1: 3 micro-batches of 4 per step
    train(engine, loader, 3 * 3)
    engine.save_checkpoint(os.path.join(root, "w1"))
    results = [unportable(r) for r in run_distributed(data_worker, 2, root)]
    ref_logs = [r["w2"]["log"] for r in results]
    ref_params = results[0]["w2"]["params"]
    check_resumed([r["w1->w2"]["log"] for r in results], ref_logs, 2)
    worst_error(results[0]["w1->w2"]["params"], ref_params, STEPS, "W=1 -> W=2")

    w1 = resumed(0, 1, 3, os.path.join(root, "w2-60-6"))
    check_resumed([w1["log"]], ref_logs, 1)
    worst_error(w1["params"], ref_params, STEPS, "W=2 -> W=1")
