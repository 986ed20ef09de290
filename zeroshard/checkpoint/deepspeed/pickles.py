"""Reading DeepSpeed's ``*.pt`` pickles without ever running code from them, and writing them.

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
import types
from collections.abc import Mapping
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


# -- writing: the stand-ins under DeepSpeed's class names -------------------------------------------
class _Pickler(pickle._Pickler):  # the pure-Python pickler
    """Pickles :class:`DeepSpeedObject` stand-ins under DeepSpeed's class names (nothing is imported)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        ds_class = getattr(obj, "ds_class", None) if isinstance(obj, type) else None
        if not isinstance(ds_class, str) or not issubclass(obj, DeepSpeedObject):
            super().save_global(obj, name)  # type: ignore[misc]
            return
        module, _, qualname = ds_class.rpartition(".")
        self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]


_PICKLE_MODULE = types.SimpleNamespace(Pickler=_Pickler, __name__="pickle")


def save_pickle(obj: Any, path: str) -> None:
    """``torch.save`` ``obj`` to ``path`` (through a temporary name), :class:`DeepSpeedObject` stand-ins
    under DeepSpeed's class names."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp, pickle_module=_PICKLE_MODULE)
    os.replace(tmp, path)


def deepspeed_loss_scaler(state: Mapping[str, Any] | None) -> DeepSpeedObject:
    """DeepSpeed's loss scaler object for zeroshard's scaler state (core/loss_scaler.py); static 1.0 when
    the run had none (fp32 and bf16)."""
    if state is None or not state.get("dynamic", False):
        scaler: DeepSpeedObject = _LossScaler()
        scaler.state = {"cur_scale": float(state["scale"]) if state else 1.0, "dynamic": False}
        return scaler
    scaler = _DynamicLossScaler()
    scaler.state = {
        "cur_scale": float(state["scale"]),
        "dynamic": True,
        "cur_iter": int(state["cur_iter"]),
        "last_overflow_iter": int(state["last_overflow_iter"]),
        "scale_factor": float(state["factor"]),
        "scale_window": int(state["window"]),
        "min_scale": float(state["min_scale"]),
        "delayed_shift": int(state["hysteresis"]),
        "cur_hysteresis": int(state["cur_hysteresis"]),
        "consecutive_hysteresis": bool(state["consecutive_hysteresis"]),
        "raise_error_at_min_scale": True,
        "dtype": torch.float16,
    }
    return scaler
