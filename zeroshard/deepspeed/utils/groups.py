"""``deepspeed.utils.groups``: DeepSpeed's public process-group queries, on a data-parallel-only job.

[Note: groups without model parallelism]
DeepSpeed creates the tensor-parallel group, and with it the model-parallel and data-parallel groups these
public getters return, in one place only: AutoTP (``tensor_parallel.autotp_size > 1``). zeroshard has no
tensor parallelism, so here, as on a data-parallel-only DeepSpeed job, those groups never exist and every
getter that needs one raises :class:`GroupNotInitializedError` with DeepSpeed's message (an
``AssertionError`` too, which is what DeepSpeed's ``assert`` raises). ZeRO's data-parallel group is the
whole world: ``deepspeed.comm.get_world_size()`` / ``get_rank()`` answer for it.

The two setters record a tensor-parallel world size and rank (Megatron-style callers set them); from then
on the matching getters answer the recorded value without a group, as DeepSpeed's do. That record is this
module's only state.
"""

from __future__ import annotations

import importlib

from torch.distributed import ProcessGroup

from zeroshard.deepspeed import comm, surface

__all__ = [
    "GroupNotInitializedError",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "initialize",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
]

# What the setters recorded (None: nothing recorded, ask the group).
_tensor_parallel_world_size: int | None = None
_tensor_parallel_rank: int | None = None

_WHY = (
    "DeepSpeed creates it only for AutoTP (tensor_parallel.autotp_size > 1), which zeroshard does not "
    "provide; ZeRO's data-parallel group is the whole world (deepspeed.comm.get_world_size() / get_rank())"
)


class GroupNotInitializedError(RuntimeError, AssertionError):
    """A DeepSpeed group that is never created without tensor parallelism was asked for.

    It is an ``AssertionError`` as well, so ``except AssertionError`` catches it as it catches DeepSpeed's.
    """


def _not_initialized(what: str) -> GroupNotInitializedError:
    return GroupNotInitializedError(f"{what} is not initialized: {_WHY}")


def initialize(ep_size: int = 1, mpu: object = None) -> None:
    """Refused as DeepSpeed refuses it: deprecated, whatever the arguments (``DeprecatedException``).

    Expert parallelism (``ep_size > 1``) belongs to mixture of experts, which zeroshard does not provide.
    """
    exceptions = importlib.import_module("zeroshard.deepspeed.utils.exceptions")
    message = (
        "Please do not use the groups.initialize() API as it is deprecated. Instead, pass the desired "
        "ep_size to deepspeed.moe.layer.MoE(..,ep_size,..)"
    )
    if ep_size > 1:
        message += " (expert parallelism belongs to mixture of experts, which zeroshard does not provide)"
    raise exceptions.DeprecatedException(message)


def get_tensor_model_parallel_group() -> ProcessGroup:
    """Never created here: raises :class:`GroupNotInitializedError` (see [Note: groups without model
    parallelism])."""
    raise _not_initialized("intra_layer_model parallel group")


def get_model_parallel_group() -> ProcessGroup:
    """Never created here: raises :class:`GroupNotInitializedError`."""
    raise _not_initialized("model parallel group")


def get_data_parallel_group() -> ProcessGroup:
    """Never created here: raises :class:`GroupNotInitializedError` (DeepSpeed's comes with AutoTP only)."""
    raise _not_initialized("data parallel group")


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    """Record the tensor-parallel world size that :func:`get_tensor_model_parallel_world_size` answers
    (``None`` forgets it)."""
    global _tensor_parallel_world_size
    _tensor_parallel_world_size = world_size


def get_tensor_model_parallel_world_size() -> int:
    """The recorded tensor-parallel world size; without one, the group's (which raises here)."""
    if _tensor_parallel_world_size is not None:
        return _tensor_parallel_world_size
    return comm.get_world_size(group=get_tensor_model_parallel_group())


def get_model_parallel_world_size() -> int:
    """:func:`get_tensor_model_parallel_world_size` (DeepSpeed's model parallelism is its tensor one)."""
    return get_tensor_model_parallel_world_size()


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    """Record the tensor-parallel rank that :func:`get_tensor_model_parallel_rank` answers (``None`` forgets
    it)."""
    global _tensor_parallel_rank
    _tensor_parallel_rank = rank


def get_tensor_model_parallel_rank() -> int:
    """The recorded tensor-parallel rank; without one, the rank in the group (which raises here)."""
    if _tensor_parallel_rank is not None:
        return _tensor_parallel_rank
    return comm.get_rank(group=get_tensor_model_parallel_group())


def get_model_parallel_rank() -> int:
    """:func:`get_tensor_model_parallel_rank`."""
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first rank of this rank's tensor-parallel block: ``rank // size * size`` with
    the tensor-parallel world size of :func:`get_tensor_model_parallel_world_size`."""
    size = get_tensor_model_parallel_world_size()
    return (comm.get_rank() // size) * size


def get_data_parallel_world_size() -> int:
    """The data-parallel group's size: raises here, as :func:`get_data_parallel_group` does."""
    return comm.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    """The rank in the data-parallel group: raises here, as the group does."""
    return comm.get_rank(group=get_data_parallel_group())


__getattr__ = surface.fallback(__name__)  # the DeepSpeed names not written here
