"""This process's random number generator states, as checkpoint-storable values (tensors and JSON)."""

from __future__ import annotations

import random
from typing import Any

import torch


def get_rng_state() -> dict[str, Any]:
    """Python's, torch's CPU (and CUDA, when initialized) and numpy's (when installed) generator states."""
    version, internal, gauss = random.getstate()
    # Python's and numpy's Mersenne Twister words go in tensors, not JSON lists of 625 numbers.
    state: dict[str, Any] = {
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [
        str(kind),
        torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        int(pos),
        int(has_gauss),
        float(cached),
    ]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (generators absent here or there are left alone)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(int(k) for k in internal.tolist()), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
