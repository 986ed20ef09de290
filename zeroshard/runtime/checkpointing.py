"""The engine's checkpoint methods: DeepSpeed's names over ``zeroshard.checkpoint``.

:class:`CheckpointMethods` is a base class of :class:`zeroshard.ZeroshardEngine`. Each method checks that
every rank entered it (``collective_api``, [Note: liveness]), brings the offloaded optimizer state into
memory for the call and hands the engine, as a :class:`~zeroshard.checkpoint.state.TrainingState`, to the
function that does the work.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from zeroshard.core.liveness import collective_api
from zeroshard.errors import ArgumentTypeError

if TYPE_CHECKING:
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
    ) -> str:
        """Sharded, atomic checkpoint (see zeroshard.checkpoint.save_checkpoint); ``format="deepspeed"``
        writes DeepSpeed's ZeRO layout instead (see checkpoint/deepspeed/writer.py). ``keep_last=N``
        deletes the oldest checkpoints of ``save_dir`` beyond the newest N (zeroshard format). Collective.

        Raises:
            ArgumentTypeError: ``save_dir`` is not a path (``None``): a ``TypeError`` and DeepSpeed's
                ``ValueError``.
            ValueError: ``save_dir`` is empty, as in DeepSpeed; ``tag`` is not a usable directory name.
            ArgumentError: The ranks gave different tags under ``checkpoint.tag_validation: FAIL`` (a
                ``ValueError`` and DeepSpeed's ``AssertionError``).
        """
        from zeroshard.checkpoint import save_checkpoint
        from zeroshard.checkpoint.deepspeed.writer import save_as_deepspeed

        if format not in ("zeroshard", "deepspeed"):
            raise ValueError(f"save_checkpoint(format={format!r}): expected 'zeroshard' or 'deepspeed'")
        _check_save_dir(save_dir)
        api = collective_api(self.comm, "save_checkpoint", self.global_steps)
        with api, self.offload.resident(write_back=False):
            if format == "deepspeed":
                if keep_last is not None:
                    raise ValueError("save_checkpoint(keep_last=...) applies to format='zeroshard' only")
                return save_as_deepspeed(
                    self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters
                )
            return save_checkpoint(
                self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, keep_last
            )

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
        with api, self.offload.resident(write_back=True):
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
