"""The data loader ``initialize(training_data=...)`` returns: DistributedSampler's order, resumable.

[Note: data position]
DistributedSampler orders epoch ``e`` by one permutation of the dataset (seeded with ``seed + e``, padded
at its end to a multiple of the world size W) and gives rank ``r`` the positions ``r, r + W, r + 2W, ...``
of it. Ranks advance in lockstep (one micro-batch each per micro-step), so once every rank has handed
out ``k`` samples of the epoch, the run has consumed exactly the first ``c = k * W`` positions of the
permutation. ``(epoch, c)``, with the seed and the shuffle flag, is the loader's whole position, and it
means the same at any world size: resuming at W' starts every rank ``c / W'`` samples into its share,
which continues the same permutation at position ``c``.

When W' does not divide ``c``, each rank starts ``c // W'`` samples in (rounded down): the last
``c mod W'`` samples before the checkpoint are seen again, none is skipped, and a warning says so. When
``c`` reaches the dataset's length the epoch is over: the resumed pass is empty, and the next
``set_epoch`` starts the next epoch.

A resumed position applies to the next pass (``iter()``) only; every later pass of an epoch starts at
its beginning, as DistributedSampler's do. A loader the user builds is not this class and carries no
position: such a script keeps its own in ``client_state``.

A checkpoint saved inside an accumulation window resumes at the window's first micro-step (see
checkpoint/save.py [Note: saving inside an accumulation window]), so the position it records is the one
before the window's micro-batches: ``state_dict(rewind=k)`` reaches back ``k`` batches (one batch per
micro-step, as a training loop takes them), also into the previous epoch.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger(__name__)

_STATE_KEYS = ("epoch", "consumed_samples", "seed", "shuffle", "dataset_length")


class ResumableSampler(DistributedSampler[int]):
    """DistributedSampler (with its padding) whose next pass can begin part-way into this rank's share.

    Invariants: ``start`` is where the next ``iter()`` begins in this rank's share (0 unless a position
    was loaded and not yet used); ``yielded`` counts the samples of epoch ``epoch``'s current pass that
    the loader has handed out, ``start`` included; both are at most ``num_samples``.
    """

    def __init__(self, dataset: Dataset[Any], *, num_replicas: int, rank: int, shuffle: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle)
        self.start = 0
        self.yielded = 0

    def __iter__(self) -> Iterator[int]:
        start, self.start = self.start, 0  # a loaded position serves one pass
        return itertools.islice(super().__iter__(), start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start

    def set_epoch(self, epoch: int) -> None:
        """Order the next pass by ``epoch``; a new epoch starts at its beginning, the current one stays put
        (so ``set_epoch(loader.epoch)`` after a resume keeps the resumed position)."""
        if epoch != self.epoch:
            if self.start and self.rank == 0:
                logger.warning(
                    "set_epoch(%d) drops the data position resumed in epoch %d (%d samples consumed): "
                    "call set_epoch(loader.epoch) first to finish the resumed epoch",
                    epoch,
                    self.epoch,
                    self.start * self.num_replicas,
                )
            self.start = 0
            self.yielded = 0
        super().set_epoch(epoch)


class ResumableDataLoader(DataLoader[Any]):
    """A DataLoader over a :class:`ResumableSampler` that counts the samples it hands out.

    ``engine.save_checkpoint`` records :meth:`state_dict` and ``engine.load_checkpoint`` restores it, so
    that the next pass continues the saved run's data stream, also at another world size (see
    [Note: data position]). A batch counts as consumed once the loader has yielded it.

    ``rewind_limit`` is how many batches back :meth:`state_dict` can reach (the accumulation steps).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        sampler: ResumableSampler,
        batch_size: int,
        collate_fn: Callable[..., Any] | None = None,
        drop_last: bool = False,
        rewind_limit: int = 1,
    ) -> None:
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last
        )
        self.position = sampler
        """The sampler, typed: it holds the epoch and the position in it."""
        self._before: deque[tuple[int, int]] = deque(maxlen=max(rewind_limit, 1))
        """(epoch, yielded) before each of the last batches yielded since the loader was built or loaded."""

    def set_rewind_limit(self, limit: int) -> None:
        """How many batches back :meth:`state_dict` can reach from now on (``engine.set_train_batch_size``
        changes the accumulation steps); the batches already recorded are kept."""
        self._before = deque(self._before, maxlen=max(limit, 1))

    @property
    def epoch(self) -> int:
        """The epoch whose order the next pass follows (the resumed one after a load)."""
        return int(self.position.epoch)

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's ``set_epoch``, also reachable as ``loader.sampler.set_epoch``."""
        self.position.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator, not a _BaseDataLoaderIter
        sampler, share = self.position, self.position.num_samples
        sampler.yielded = sampler.start  # this pass begins where a loaded position says, else at 0
        step = self.batch_size or 1
        for batch in super().__iter__():
            self._before.append((int(sampler.epoch), sampler.yielded))
            sampler.yielded = min(sampler.yielded + step, share)
            yield batch

    def state_dict(self, rewind: int = 0) -> dict[str, Any]:
        """The position as JSON values: epoch, samples of it consumed by all ranks, seed, shuffle.

        ``rewind``: the position ``rewind`` batches ago (the start of an unfinished accumulation window).
        A loader that has yielded nothing since it was built or loaded fed no such window: its current
        position is the one.
        """
        s = self.position
        epoch, yielded = int(s.epoch), s.yielded
        if 0 < rewind <= len(self._before):
            epoch, yielded = self._before[-rewind]
        elif rewind > 0 and self._before and s.rank == 0:
            logger.warning(
                "data position: the loader yielded %d batches since it was built or loaded, fewer than the "
                "%d of the unfinished accumulation window: recording its current position",
                len(self._before),
                rewind,
            )
        return {
            "epoch": epoch,
            "consumed_samples": yielded * s.num_replicas,
            "seed": int(s.seed),
            "shuffle": bool(s.shuffle),
            "dataset_length": _length(s.dataset),
            "world_size": s.num_replicas,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`, possibly saved at another world size).

        A dataset of another length has another permutation: the position is then not restored (a
        warning says so) and the loader starts where it was.

        Raises:
            ValueError: ``state`` lacks a key or holds a negative count.
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"data loader state {dict(state)} lacks {missing}")
        s = self.position
        consumed, length = int(state["consumed_samples"]), _length(s.dataset)
        if consumed < 0 or int(state["epoch"]) < 0:
            raise ValueError(f"data loader state {dict(state)}: epoch and consumed_samples must be >= 0")
        if int(state["dataset_length"]) != length:
            if s.rank == 0:
                logger.warning(
                    "data position not restored: it was saved over a dataset of %s samples, this one has %d",
                    state["dataset_length"],
                    length,
                )
            return
        s.seed, s.shuffle = int(state["seed"]), bool(state["shuffle"])
        s.start = 0  # a position loaded before and not used yet is replaced, silently
        s.set_epoch(int(state["epoch"]))
        if consumed >= length:  # every sample of the epoch was seen: nothing left of it
            start = s.num_samples
        else:
            start = min(consumed // s.num_replicas, s.num_samples)
            again = consumed - start * s.num_replicas
            if again and s.rank == 0:
                logger.warning(
                    "resuming the data at world size %d from %d samples consumed (saved at world size %s): "
                    "%d does not divide by %d, so each rank starts %d samples in and the last %d samples "
                    "before the checkpoint are seen again",
                    s.num_replicas,
                    consumed,
                    state.get("world_size"),
                    consumed,
                    s.num_replicas,
                    start,
                    again,
                )
        s.start = s.yielded = start
        self._before.clear()


def _length(dataset: Any) -> int:
    if not isinstance(dataset, Sized):
        raise TypeError(f"a resumable data loader needs a dataset with len(), got {type(dataset).__name__}")
    return len(dataset)


def build_loader(
    dataset: Dataset[Any],
    *,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    collate_fn: Callable[..., Any] | None = None,
    drop_last: bool = False,
    accumulation_steps: int = 1,
) -> ResumableDataLoader:
    """The loader ``initialize`` returns: shuffled with DistributedSampler's seed 0, ``micro_batch_size``
    samples per batch, ``drop_last`` dropping each rank's incomplete last batch."""
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    return ResumableDataLoader(
        dataset,
        sampler=sampler,
        batch_size=micro_batch_size,
        collate_fn=collate_fn,
        drop_last=drop_last,
        rewind_limit=accumulation_steps,
    )
