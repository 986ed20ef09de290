"""The background writer of ``save_checkpoint(async_save=True)``: one thread per engine, file I/O only.

[Note: async save]
An asynchronous save runs the collective phases of [Note: atomic save] on the calling (main) thread and moves
only the file writing to a background thread:

1. On the main thread, in ``save_checkpoint``: agree on the tag and token, create the temporary directory,
   copy this rank's shard tensors (and on rank 0 the tensors metadata.json refers to) to host memory, gather
   the RNG states and data positions, and build metadata.json's content (rank 0). Training may change the
   shards as soon as the call returns: the writer holds copies, in buffers it keeps from one save to the
   next ([Note: host snapshot buffers]).
2. On the background thread: write and fsync this rank's files (shard; rank 0 also ``extra.safetensors``),
   hashing them as they go out, then write a small marker ``.written-rank<r>.json`` with their sizes and
   checksums (``.failed-rank<r>.json`` with the error if a write failed). Nothing else: no collective runs
   on this thread, so it never races the training loop's collectives on the same process group.
3. At the next wait point, on the main thread, collectively: every rank waits for its own write; a failure on
   any rank raises on every rank, naming the rank and the file; then the sizes and checksums are gathered,
   rank 0 writes metadata.json and publishes (rename, ``latest``, pruning) exactly as a synchronous save.
   The wait points are the next ``save_checkpoint``, ``load_checkpoint``, ``wait_for_checkpoint`` and
   ``destroy``/interpreter exit.
4. At ``destroy``, garbage collection of the engine or interpreter exit (no collective is possible there: a
   peer may be gone, the process group torn down) each rank waits for its own write, at most
   ``EXIT_TIMEOUT_S``; rank 0 then waits, within the same bound, for every rank's marker, and publishes when
   all of them report success. On a timeout or a failure it logs the file and leaves the temporary directory
   (``latest`` still names the previous checkpoint; the next save removes the leftover).

So ``latest`` only ever names a checkpoint whose every file was fsynced, and a crash (``kill -9``) at any
moment leaves at worst a ``.tmp-`` directory nothing reads, as for a synchronous save.

The thread is a daemon thread fed by a queue, with :class:`concurrent.futures.Future` results, rather than a
``ThreadPoolExecutor``: the interpreter joins an executor's workers at exit without a bound, before any
``atexit`` hook could bound the wait.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.host_buffers import SnapshotBuffers

logger = logging.getLogger(__name__)

# How long destroy / interpreter exit waits for a background write (and rank 0 for the others' markers).
EXIT_TIMEOUT_S = 600.0

Records = dict[str, dict[str, Any]]  # file name -> {"bytes": int, "sha256": str}


@dataclass
class PendingSave:
    """A save whose files are being written in the background; published by :func:`save.finish_pending`.

    Attributes:
        root: the save directory. tmp: the temporary directory the files go to. tag, token: as in
            [Note: atomic save]. save_latest, keep_last: the arguments of the save.
        meta: metadata.json's content without the files' sizes and checksums (rank 0; None elsewhere).
        result: this rank's written files, once the background write finished.
    """

    root: str
    tmp: str
    tag: str
    token: str
    save_latest: bool
    keep_last: int | None
    meta: dict[str, Any] | None
    result: Future[Records] = field(default_factory=Future)


def marker_path(tmp: str, rank: int, ok: bool) -> str:
    return os.path.join(tmp, f".{'written' if ok else 'failed'}-rank{rank}.json")


def _write_marker(path: str, content: Any) -> None:
    """Write ``content`` as JSON under ``path`` atomically (a reader never sees half a marker)."""
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def remove_markers(tmp: str) -> None:
    """Delete the markers of ``tmp`` before it is published (they are not part of a checkpoint)."""
    for name in os.listdir(tmp):
        if name.startswith((".written-rank", ".failed-rank")):
            os.remove(os.path.join(tmp, name))


def _yield_to_training() -> None:
    """Run this thread under Linux's ``SCHED_IDLE`` policy (Linux schedules threads one by one): it runs only
    on a core no other thread wants, and a training thread that wakes (a collective completed) takes the core
    back at once, where a merely low-priority thread would finish its time slice first. Where the policy
    cannot be set, the lowest nice value; elsewhere the thread keeps the process's priority."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass


class CheckpointWriter:
    """One engine's background writer: at most one pending save, written by one daemon thread.

    Invariants: ``pending`` is the save submitted last and not yet published or abandoned; its ``result``
    completes (with the records or the error) once the thread finished writing it. ``host`` holds the
    copies the saves write, kept from one save to the next ([Note: host snapshot buffers]).
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pending: PendingSave | None = None
        self._jobs: queue.SimpleQueue[tuple[PendingSave, Callable[[], Records]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.host = SnapshotBuffers()

    def submit(self, save: PendingSave, write: Callable[[], Records]) -> None:
        """Write ``save``'s files in the background with ``write`` (file I/O only, never a collective)."""
        if self.pending is not None:
            raise RuntimeError(
                f"rank {self.rank}: checkpoint writer: a save of {self.pending.tmp} is still pending; "
                "wait for it before submitting another"
            )
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="zeroshard-checkpoint-writer", daemon=True)
            self._thread.start()
        self.pending = save
        self.host.lend(save.result)  # the buffers are not written again before this write ends
        self._jobs.put((save, write))

    def take_pending(self) -> PendingSave | None:
        """The pending save, which the caller now publishes or abandons (so it is never waited for twice)."""
        save, self.pending = self.pending, None
        return save

    def _run(self) -> None:
        _yield_to_training()
        while (job := self._jobs.get()) is not None:
            save, write = job
            del job  # the write closure holds views of the host buffers: dropped once written, below
            if not save.result.set_running_or_notify_cancel():
                continue
            try:
                records = write()
                _write_marker(marker_path(save.tmp, self.rank, True), records)
            except BaseException as err:  # handed to whoever waits, naming the file
                try:
                    _write_marker(marker_path(save.tmp, self.rank, False), f"{err}")
                except OSError:
                    pass  # the directory itself is unusable; rank 0 times out waiting, then logs
                save.result.set_exception(err)
            else:
                save.result.set_result(records)
            del save, write

    def close(self, timeout: float = EXIT_TIMEOUT_S) -> Records | None:
        """Wait (at most ``timeout`` seconds) for the pending save; on rank 0, publish it when every rank's
        marker reports success (see [Note: async save], step 4). Not collective: runs at destroy and exit.

        Returns:
            The records gathered from every rank's marker when rank 0 may publish, else None.
        """
        save = self.take_pending()
        self.host.release()  # a write still running keeps its views alive until it ends
        thread, self._thread = self._thread, None
        deadline = time.monotonic() + timeout
        if thread is not None:
            self._jobs.put(None)  # the thread ends after the pending write; a later save starts another
            # Joined, not left running: a thread still in torch while the interpreter exits can abort it.
            thread.join(timeout)
        if save is None:
            return None
        try:
            save.result.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            logger.error(
                "rank %d: the checkpoint write to %s did not finish in %.0f s", self.rank, save.tmp, timeout
            )
            return None
        except Exception as err:
            logger.error("rank %d: the checkpoint write to %s failed: %s", self.rank, save.tmp, err)
            return None
        if self.rank != 0:
            return None
        return self._markers(save, deadline)

    def _markers(self, save: PendingSave, deadline: float) -> Records | None:
        """Every rank's records from its marker, or None (logged) on a failure or past ``deadline``."""
        records: Records = {}
        waiting = set(range(self.world_size))
        while waiting:
            for rank in sorted(waiting):
                failed = marker_path(save.tmp, rank, False)
                if os.path.exists(failed):
                    with open(failed, encoding="utf-8") as f:
                        logger.error("checkpoint %s not published: rank %d: %s", save.tmp, rank, json.load(f))
                    return None
                path = marker_path(save.tmp, rank, True)
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as f:
                        records.update(json.load(f))
                    waiting.discard(rank)
            if waiting and time.monotonic() > deadline:
                logger.error(
                    "checkpoint %s not published: ranks %s did not finish writing", save.tmp, sorted(waiting)
                )
                return None
            if waiting:
                time.sleep(0.05)
        return records


def named(path: str, err: BaseException) -> CheckpointError:
    """A background write's error, naming the file it was writing."""
    return CheckpointError(f"writing {path} in the background failed: {err}")
