"""The engine's checkpoint methods: DeepSpeed's names over ``zeroshard.checkpoint``.

:class:`CheckpointMethods` is a base class of :class:`zeroshard.ZeroshardEngine`. Each method checks that
every rank entered it (``collective_api``, [Note: liveness]), brings the offloaded optimizer state into
memory for the call and hands the engine, as a :class:`~zeroshard.checkpoint.state.TrainingState`, to the
function that does the work.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from zeroshard.core.liveness import collective_api
from zeroshard.errors import ArgumentTypeError

if TYPE_CHECKING:
    from zeroshard.checkpoint.async_write import CheckpointWriter
    from zeroshard.checkpoint.state import TrainingState
    from zeroshard.offload.setup import Offload

    class _Checkpointable(TrainingState, Protocol):
        offload: Offload


__all__ = ["CheckpointMethods"]


def _check_save_dir(save_dir: object) -> None:
    """A save directory is a non-empty path; DeepSpeed raises ``ValueError`` for ``None`` and ``""``."""
    if not isinstance(save_dir, str | os.PathLike):
        raise ArgumentTypeError(
            f"save_checkpoint(save_dir={save_dir!r}): expected a directory path (str or os.PathLike)"
        )
    if not os.fspath(save_dir):
        raise ValueError("save_checkpoint(save_dir=''): expected a directory path, got an empty string")


def _writer(engine: _Checkpointable) -> CheckpointWriter:
    """The engine's background checkpoint writer, made at its first asynchronous save.

    A finalizer publishes (or, past its bound, abandons) a pending save when the engine is collected or the
    interpreter exits, without a collective ([Note: async save], step 4); it holds the writer, not the engine.
    """
    from zeroshard.checkpoint.async_write import CheckpointWriter
    from zeroshard.checkpoint.save import finish_at_exit

    writer: CheckpointWriter | None = engine.__dict__.get("_checkpoint_writer")
    if writer is None:
        writer = CheckpointWriter(engine.comm.rank, engine.comm.world_size)
        engine.__dict__["_checkpoint_writer"] = writer
        weakref.finalize(engine, finish_at_exit, writer)
    return writer


def close_checkpoint_writer(engine: object) -> None:
    """Publish or abandon the pending asynchronous save without a collective (``destroy``); bounded."""
    from zeroshard.checkpoint.save import finish_at_exit

    writer = engine.__dict__.get("_checkpoint_writer")
    if writer is not None:
        finish_at_exit(writer)


def _in_background(engine: _Checkpointable, format: str, keep_last: int | None, async_save: object) -> bool:
    """Whether a save writes in the background: ``async_save``, else ``checkpoint.writer.decoupled``."""
    if async_save is not None and not isinstance(async_save, bool):
        raise ArgumentTypeError(f"save_checkpoint(async_save={async_save!r}): expected a bool or None")
    if format == "deepspeed" and (keep_last is not None or async_save):
        which = "keep_last" if keep_last is not None else "async_save"
        raise ValueError(f"save_checkpoint({which}=...) applies to format='zeroshard' only")
    if async_save is not None:
        return format == "zeroshard" and async_save
    writer = engine.config.checkpoint.writer
    return format == "zeroshard" and writer is not None and writer.decoupled


def _finish_pending(engine: _Checkpointable) -> str | None:
    """Wait for and publish the engine's asynchronous save, if one is in flight. Collective."""
    from zeroshard.checkpoint.save import finish_pending

    writer = engine.__dict__.get("_checkpoint_writer")
    return None if writer is None else finish_pending(engine.comm, writer)


class CheckpointMethods:
    """``save_checkpoint``, ``load_checkpoint`` and ``save_16bit_model``. Collective: call on all ranks."""

    def save_checkpoint(
        self: _Checkpointable,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        format: str = "zeroshard",
        keep_last: int | None = None,
        *,
        async_save: bool | None = None,
    ) -> str:
        """Sharded, atomic checkpoint (see zeroshard.checkpoint.save_checkpoint); ``format="deepspeed"``
        writes DeepSpeed's ZeRO layout instead (see checkpoint/deepspeed/writer.py). ``keep_last=N``
        deletes the oldest checkpoints of ``save_dir`` beyond the newest N (zeroshard format). Collective.

        ``async_save=True`` (default: the config's ``checkpoint.writer.decoupled``; zeroshard format only)
        returns once this rank's shards are copied to host memory and writes them on a background thread;
        ``latest`` moves at the next wait point (the next save or load, :meth:`wait_for_checkpoint`,
        ``destroy``, exit), which also raises a failure of the write. See [Note: async save]. Every save
        first waits for the previous asynchronous one.

        Raises:
            ArgumentTypeError: ``save_dir`` is not a path (``None``): a ``TypeError`` and DeepSpeed's
                ``ValueError``.
            ValueError: ``save_dir`` is empty, as in DeepSpeed; ``tag`` is not a usable directory name.
            ArgumentError: The ranks gave different tags under ``checkpoint.tag_validation: FAIL`` (a
                ``ValueError`` and DeepSpeed's ``AssertionError``).
            CheckpointError: The previous asynchronous save failed (naming the rank and the file).
        """
        from zeroshard.checkpoint import save_checkpoint
        from zeroshard.checkpoint.deepspeed.writer import save_as_deepspeed

        if format not in ("zeroshard", "deepspeed"):
            raise ValueError(f"save_checkpoint(format={format!r}): expected 'zeroshard' or 'deepspeed'")
        _check_save_dir(save_dir)
        background = _in_background(self, format, keep_last, async_save)
        api = collective_api(self.comm, "save_checkpoint", self.global_steps)
        with api:
            _finish_pending(self)
            with self.offload.resident(write_back=False):
                if format == "deepspeed":
                    return save_as_deepspeed(
                        self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters
                    )
                writer = _writer(self) if background else None
                return save_checkpoint(
                    self,
                    save_dir,
                    tag,
                    client_state,
                    save_latest,
                    exclude_frozen_parameters,
                    keep_last,
                    writer=writer,
                )

    def wait_for_checkpoint(self: _Checkpointable) -> str | None:
        """Wait for the asynchronous save in flight on every rank, then publish it (move ``latest``).

        DeepSpeed's decoupled writer commits at the next optimizer step; zeroshard commits at this call and
        at the next save or load. Collective: call on all ranks.

        Returns:
            The published checkpoint directory, or None when no save was in flight.

        Raises:
            CheckpointError: The background write failed on some rank (naming the rank and the file); the
                partial checkpoint is removed and ``latest`` still names the previous one.
        """
        with collective_api(self.comm, "save_checkpoint", self.global_steps):  # it ends a save
            return _finish_pending(self)

    def load_checkpoint(
        self: _Checkpointable,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, Any]:
        """Load a checkpoint saved at any world size and stage (see zeroshard.checkpoint). Collective."""
        from zeroshard.checkpoint import load_checkpoint

        api = collective_api(self.comm, "load_checkpoint", self.global_steps)
        with api:
            _finish_pending(self)  # the checkpoint being loaded may be the one in flight
            with self.offload.resident(write_back=True):
                return load_checkpoint(
                    self,
                    load_dir,
                    tag,
                    load_module_strict,
                    load_optimizer_states,
                    load_lr_scheduler_states,
                    load_module_only,
                )

    def save_16bit_model(
        self: _Checkpointable,
        save_dir: str,
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Consolidated weights in the compute dtype, safetensors (see zeroshard.checkpoint). Collective."""
        from zeroshard.checkpoint import save_16bit_model

        api = collective_api(self.comm, "save_16bit_model", self.global_steps)
        with api, self.offload.resident(write_back=False):
            return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)
