"""DeepSpeed's engine config queries as methods: one per entry of the table in ``query_table.py``
([Note: engine queries] there), over the behaviour methods of ``methods.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zeroshard.config import ZeroshardConfig
from zeroshard.core.precision import DTYPES
from zeroshard.runtime.methods import DeepSpeedMethods
from zeroshard.runtime.query_table import QUERIES, Query

__all__ = ["QUERIES", "DeepSpeedQueries", "Query"]


def _method(name: str, query: Query) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return query.read(self.config)

    method.__name__ = name
    method.__qualname__ = f"DeepSpeedQueries.{name}"
    note = f" {query.note}" if query.note else ""
    method.__doc__ = f"DeepSpeed's ``engine.{name}()``: {query.reads}.{note}"
    return method


def _communication_data_type(config: ZeroshardConfig) -> torch.dtype:
    if config.communication_data_type is not None:
        return DTYPES[config.communication_data_type]
    return torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else torch.float32


class DeepSpeedQueries(DeepSpeedMethods):
    """DeepSpeed's config queries (one method per :data:`QUERIES` entry, see [Note: engine queries]) over
    the behaviour methods of :class:`~zeroshard.runtime.methods.DeepSpeedMethods`."""

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's ``communication_data_type``, else the compute
        dtype (fp16, bf16 or fp32), as DeepSpeed's property answers."""
        return _communication_data_type(self.config)

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise NotImplementedError(
            f"engine.communication_data_type = {value!r}: zeroshard fixes the dtype gradients are reduced in "
            "when it builds the engine; set communication_data_type in the ds_config instead"
        )

    def step_breakdown(self) -> dict[str, float]:
        """Where the last optimizer step's time went with the optimizer in CPU memory beside a GPU, in
        seconds ([Note: overlapped offload step]): ``grad_copy_wait_s`` (waiting for gradient shards to reach
        the CPU), ``cpu_step_s`` (the optimizer on the CPU, with the casts of the stepped values),
        ``param_copy_wait_s`` (the end of the step's copies back); on a GPU also ``d2h_s`` and ``h2d_s``, the
        time the side stream spent copying (beside the computation) since the step before. Empty without
        such an offload.
        With ``wall_clock_breakdown`` they are added to the timers the log line prints."""
        host_step = self.offload.host_step
        return dict(host_step.timings) if host_step is not None else {}

    def mics_shard_size(self) -> int:
        """DeepSpeed's ``engine.mics_shard_size()``: the config's ``zero_optimization.mics_shard_size``
        (-1: off; core/hybrid.py [Note: hybrid sharding])."""
        return self.config.zero_optimization.mics_shard_size


for _name, _query in QUERIES.items():
    setattr(DeepSpeedQueries, _name, _method(_name, _query))
del _name, _query
