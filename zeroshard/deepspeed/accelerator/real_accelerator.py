"""DeepSpeed's accelerator object, for the two devices zeroshard trains on: CUDA and the CPU.

Every method is a name over torch (``torch.cuda`` or its CPU equivalent); nothing is cached except the
choice of device, made on the first ``get_accelerator()`` call: CUDA when torch can use it, else the CPU
(DeepSpeed's ``DS_ACCELERATOR`` variable may say ``cpu`` or ``cuda``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.deepspeed import surface
from zeroshard.dist import default_backend

__all__ = [
    "CPU_Accelerator",
    "CUDA_Accelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]


class DeepSpeedAccelerator:
    """What both devices share; subclasses name the device and its torch module."""

    _name = ""
    _communication_backend_name = "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_available(self) -> bool:
        return True

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def is_triton_supported(self) -> bool:
        return False

    def amp(self) -> Any:
        return torch.amp

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned()) if torch.cuda.is_available() else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # RNG: torch's global generator serves the CPU; CUDA has its own per device.
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def seed(self) -> None:
        torch.seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    def Stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"streams on {self._name}")

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def range_push(self, msg: str) -> None:
        return None

    def range_pop(self) -> None:
        return None

    def op_builder_dir(self) -> str:
        return "deepspeed.ops.op_builder"

    def create_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(
            f"op builder {class_name}: zeroshard has no compiled DeepSpeed ops; its optimizers are in "
            "deepspeed.ops.adam / deepspeed.ops.lamb"
        )

    def get_op_builder(self, class_name: str) -> Any:
        return self.create_op_builder(class_name)


class CUDA_Accelerator(DeepSpeedAccelerator):
    """``torch.cuda`` under DeepSpeed's names."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def is_bf16_supported(self) -> bool:
        return bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        return torch.cuda.is_available()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def seed(self) -> None:
        torch.cuda.seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    def Stream(self, *args: Any, **kwargs: Any) -> Any:
        return torch.cuda.Stream(*args, **kwargs)

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    def Event(self, **kwargs: Any) -> Any:
        return torch.cuda.Event(**kwargs)

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(device_index or 0).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def is_synchronized_device(self) -> bool:
        return False


class CPU_Accelerator(DeepSpeedAccelerator):
    """The CPU under DeepSpeed's accelerator names: one device, index 0, memory from the process."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def device_count(self) -> int:
        # As DeepSpeed's CPU accelerator: the processes per node its launcher declares (LOCAL_SIZE), else 1
        # (DeepSpeed counts NUMA nodes there; zeroshard runs any number of ranks on any CPU).
        local = os.environ.get("LOCAL_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else 1

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def is_synchronized_device(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def empty_cache(self) -> None:
        return None

    def _rss(self) -> int:
        try:
            import psutil
        except ImportError:
            return 0
        return int(psutil.Process().memory_info().rss)

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        return None

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._rss()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        return None

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return {"allocated_bytes.all.current": self._rss()}

    def total_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, device_index: int | None = None) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


_ACCELERATORS: dict[str, type[DeepSpeedAccelerator]] = {"cuda": CUDA_Accelerator, "cpu": CPU_Accelerator}
_chosen: list[DeepSpeedAccelerator] = []


def get_accelerator() -> DeepSpeedAccelerator:
    """This process's accelerator: CUDA when usable (or ``DS_ACCELERATOR=cuda``), else the CPU."""
    if not _chosen:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if default_backend() == "nccl" else "cpu")
        if name not in _ACCELERATORS:
            raise ValueError(
                f"DS_ACCELERATOR={name!r} is not supported by zeroshard; "
                f"expected one of {sorted(_ACCELERATORS)}"
            )
        _chosen.append(_ACCELERATORS[name]())
    return _chosen[0]


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Use ``accel_obj`` from now on (DeepSpeed's name)."""
    _chosen[:] = [accel_obj]


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one DeepSpeed supports (its ``SUPPORTED_ACCELERATOR_LIST``)."""
    supported: list[str] = getattr(sys.modules[__name__], "SUPPORTED_ACCELERATOR_LIST")  # noqa: B009
    return get_accelerator().device_name() in supported


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
