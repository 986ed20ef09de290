"""``deepspeed.git_version_info``: what DeepSpeed's build records, answered for zeroshard.

DeepSpeed's ``setup.py`` writes these values when it builds (the ops it compiled, the torch and CUDA it
compiled against). zeroshard builds nothing, so:

- ``version`` is ``deepspeed.__version__`` (the DeepSpeed release this API follows, with zeroshard's version
  as a local label); ``git_hash`` and ``git_branch`` are ``"unknown"``;
- ``installed_ops`` maps every op builder's ``NAME`` to False: no op is prebuilt (``deepspeed.ops.op_builder``
  says which ones zeroshard provides in PyTorch);
- ``torch_info`` describes the torch this process runs (there is no build-time torch): ``version`` as
  ``"major.minor"``, ``bf16_support``, and ``cuda_version`` / ``nccl_version`` / ``hip_version`` as
  ``"major.minor"`` or ``"0.0"`` when absent, DeepSpeed's value for "not built with it";
- ``accelerator_name`` is ``"cuda"`` when torch can use CUDA, else ``"cpu"`` (the two devices zeroshard
  trains on).
"""

from __future__ import annotations

import torch

from zeroshard.deepspeed import __version__ as _version
from zeroshard.deepspeed import surface
from zeroshard.deepspeed.ops.op_builder import ALL_BUILDERS

__all__ = ["accelerator_name", "git_branch", "git_hash", "installed_ops", "torch_info", "version"]

version: str = _version
git_hash = "unknown"
git_branch = "unknown"
installed_ops: dict[str, bool] = {builder.NAME: False for builder in ALL_BUILDERS}
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text: str | None) -> str:
    return ".".join(text.split("+")[0].split(".")[:2]) if text else "0.0"


def _nccl_version() -> str:
    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        return "0.0"
    found = torch.cuda.nccl.version()  # (major, minor, patch); an int such as 2708 before NCCL 2.9
    major, minor = (found[0], found[1]) if isinstance(found, tuple) else (found // 1000, found % 1000 // 100)
    return f"{major}.{minor}"


torch_info: dict[str, str | bool] = {
    "version": _major_minor(torch.__version__),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(torch.version.hip),
}

__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
