"""The state-dict hooks a stage-3 engine installs on its model (see [Note: local state_dict] below)."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from zeroshard.core.flat_param import FlatUnit
from zeroshard.zero import TrainedParameters

logger = logging.getLogger(__name__)

__all__ = ["install_state_dict_hooks"]


def install_state_dict_hooks(model: nn.Module, trained: TrainedParameters) -> None:
    """``model.state_dict()`` stays local; ``load_state_dict`` reaches the master shards.

    [Note: local state_dict]
    ``state_dict()`` never communicates, so that ``if rank == 0: model.state_dict()`` returns at once instead
    of waiting in a collective the other ranks never join (DeepSpeed and FSDP2 are local here too). At stages
    0-2 it holds the full parameters. At stage 3 it holds whatever the parameters are at the time: full
    values inside ``engine.gathered_parameters()`` or ``GatheredParameters``, DeepSpeed's empty placeholders
    outside, with a warning (once per model) that says how to get full values: ``engine.full_state_dict()``
    on all ranks, or ``engine.save_16bit_model`` / ``save_checkpoint``. ``load_state_dict`` gathers the units
    the incoming state names and writes the loaded values into their master shards: collective at stage 3
    (call it on all ranks with the same state). The hooks hold ``trained``: while the model lives,
    ``GatheredParameters`` finds its parameters' units.
    """
    units, gatherer = trained.units, trained.gatherer
    held: list[contextlib.ExitStack] = []
    warned = [False]

    def warn_if_placeholders(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if warned[0] or gatherer is None or keep_vars:
            return
        if any(not u.gathered for u in units if u.plan.shard_parameters):
            warned[0] = True
            logger.warning(
                "state_dict() at ZeRO stage 3 outside a gather holds empty placeholders for the sharded "
                "parameters, as DeepSpeed's does; for full values call engine.full_state_dict() on all "
                "ranks, use `with engine.gathered_parameters():`, or save with engine.save_16bit_model() "
                "or engine.save_checkpoint()"
            )

    def gather() -> None:
        stack = contextlib.ExitStack()
        if gatherer is not None:
            stack.enter_context(gatherer.hold_all())
        held.append(stack)

    def release(*_: Any) -> None:
        if held:
            held.pop().close()

    loading: list[list[FlatUnit]] = []

    def before_load(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
        # Only units whose parameters the incoming state names take the loaded values into their masters
        # (a state with just buffers or extra state must not round the masters through the 16-bit copy).
        loading.append([u for u in units if any(prefix + name in state for name in u.names)])
        gather()

    def write_back_and_release(*_: Any) -> None:
        for unit in loading.pop() if loading else []:
            unit.full_to_master()
        release()

    model.register_state_dict_pre_hook(warn_if_placeholders)
    model.register_load_state_dict_pre_hook(before_load)
    model.register_load_state_dict_post_hook(write_back_and_release)
