"""Reading DeepSpeed's ``*.pt`` pickles without ever running code from them.

[Note: DeepSpeed pickles]
DeepSpeed writes its checkpoints with ``torch.save``: pickles. A pickle can name any importable callable
and have the loader call it, so a checkpoint from elsewhere could run code on load. Every DeepSpeed file
is therefore read with ``torch.load(weights_only=True)``, whose unpickler only builds tensors, containers
and the globals it is told to allow. Besides torch's own defaults, the only globals allowed are the
DeepSpeed classes its ZeRO checkpoints are known to contain (``ALLOWED``), and each one is bound not to
DeepSpeed's class (DeepSpeed need not be installed) but to an inert stand-in here that only records the
state it is given: nothing from DeepSpeed is imported or called. Any other global (``os.system``, a
``builtins.eval``, a class from anywhere else) makes the load fail with a CheckpointError naming it, before
it is resolved. Files are memory-mapped, so a tensor's bytes are read when it is used, not on load.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Any

import torch

from zeroshard.checkpoint.errors import CheckpointError


class DeepSpeedObject:
    """An object DeepSpeed pickled (a loss scaler, a fragment address): only its recorded attributes.

    Unpickling creates it without arguments and hands it its ``__dict__``; it never calls DeepSpeed.
    """

    ds_class = "deepspeed"

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = dict(state) if isinstance(state, dict) else {"state": state}

    def __getstate__(self) -> dict[str, Any]:
        """What pickling writes: the recorded attributes, as DeepSpeed's own object would pickle them."""
        return dict(getattr(self, "state", {}))

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, "state", {}).get(key, default)

    def __repr__(self) -> str:
        return f"{self.ds_class}({getattr(self, 'state', self.args)!r})"


class _LossScaler(DeepSpeedObject):
    ds_class = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class _DynamicLossScaler(DeepSpeedObject):
    ds_class = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class _FragmentAddress(DeepSpeedObject):
    ds_class = "deepspeed.utils.tensor_fragment.fragment_address"


class ZeroStage(int):
    """DeepSpeed's ``ZeroStageEnum`` member, unpickled as its integer value (the stage)."""

    ds_class = "deepspeed.runtime.zero.config.ZeroStageEnum"


ALLOWED: tuple[tuple[Any, str], ...] = tuple(
    (cls, cls.ds_class) for cls in (_LossScaler, _DynamicLossScaler, _FragmentAddress, ZeroStage)
)


def load_deepspeed_file(path: str) -> Any:
    """The object pickled in DeepSpeed's ``path``, read as [Note: DeepSpeed pickles] describes.

    Raises:
        CheckpointError: naming ``path`` and, for a refused pickle, the global it asked for.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: the DeepSpeed checkpoint is incomplete")
    try:
        with torch.serialization.safe_globals(list(ALLOWED)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)|(?:function|object for|but got) ([^\s,]+)", str(err))
        what = next((g for g in named.groups() if g), "") if named else ""
        raise CheckpointError(
            f"{path} was refused: its pickle asks for {what or 'an object'}, which a DeepSpeed checkpoint "
            "does not hold. zeroshard loads DeepSpeed files with torch.load(weights_only=True) and allows "
            f"only tensors, containers and {', '.join(name for _, name in ALLOWED)}; a file that needs more "
            "could run code when loaded, so it is not loaded"
        ) from err
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as a torch checkpoint: {err}") from err
