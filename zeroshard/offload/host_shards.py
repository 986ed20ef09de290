"""ZeRO-Offload and ZeRO-Infinity in CPU memory beside a GPU: where a unit's master and parameter shard live.

[Note: offload beside a device]
With ``offload_optimizer.device: cpu`` a unit's fp32 master (and the optimizer's state over it) lives in
pinned CPU memory and the optimizer steps there (``host_step.py``). With ``offload_param.device: cpu``
(stage 3) the unit's parameter shard in the compute dtype lives in pinned CPU memory too; without it, that
shard stays in GPU memory, as DeepSpeed keeps it. A unit holds a :class:`HostShards` as its store ([Note:
shard stores]), which moves values between the two memories with the engine's copies ([Note: copy
streams]):

* Stepped master values (fp32, CPU) are cast on the CPU to the compute dtype, into a small ring of pinned
  staging buffers, and copied to the GPU parameter shard (stage 3) or to this rank's slice of the full
  parameters (stages 1-2), one sub-group at a time while the CPU steps the next. With the parameter shard
  in CPU memory the cast writes it directly and nothing crosses to the GPU at the step.
* With ``offload_param`` but the master on the GPU (no optimizer offload), the stepped master is cast on
  the GPU and copied into the pinned shard.
* A gather of a shard in CPU memory copies it to the GPU ahead of use: the gatherer reads ahead along the
  previous step's order (``PrefetchSchedule.read_ahead``), and the all-gather waits for the copy on the
  GPU only. The GPU copy is dropped once the all-gather is done, so between uses no parameter bytes stay
  on the GPU; a copy read ahead is dropped when the shard changes.
* :meth:`HostShards.flush` ends a step's writes: the GPU waits for the copies into GPU memory (the step
  calls it before the post-step all-gather). Copies into the CPU shard are waited for by the host just
  before anything reads that shard next (the next read-ahead), not at the step.

Invariants: nothing reads a destination or writes a source of a copy that was not waited for; a staging
buffer is reused only after its copy is done (:class:`StagingRing`).

Local: no collectives.
"""

from __future__ import annotations

import torch

from zeroshard.core.copies import Copies, Copy
from zeroshard.core.flat_param import FlatUnit

STAGING_ELEMENTS = 1 << 24
"""Elements per pinned staging buffer (32 MiB in bf16): stepped values cross to the GPU in such pieces."""

STAGING_BUFFERS = 4
"""Staging buffers in the ring: copies of the last pieces run while the next ones are cast."""


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialized CPU tensor, page-locked when ``pin`` (copies to and from a GPU may then be async)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


class StagingRing:
    """A few pinned CPU buffers, used in turn, for values on their way to the device."""

    def __init__(self, copies: Copies, dtype: torch.dtype, pin: bool) -> None:
        self._copies = copies
        self._dtype = dtype
        self._pin = pin
        self._buffers: list[torch.Tensor] = []
        self._copying: list[Copy | None] = []
        self._next = 0

    def send(self, dst: torch.Tensor, values: torch.Tensor) -> list[Copy]:
        """Cast ``values`` (CPU) into staging buffers and start their copies into ``dst``; the copies."""
        out = []
        for lo in range(0, values.numel(), STAGING_ELEMENTS):
            n = min(STAGING_ELEMENTS, values.numel() - lo)
            buf = self._take(n)
            buf.copy_(values[lo : lo + n])
            copy = self._copies.start(dst[lo : lo + n], buf)
            self._copying[self._next] = copy
            self._next = (self._next + 1) % STAGING_BUFFERS
            out.append(copy)
        return out

    def _take(self, numel: int) -> torch.Tensor:
        """The next buffer of the ring, its last copy done, with at least ``numel`` elements."""
        if not self._buffers:
            self._buffers = [torch.empty(0, dtype=self._dtype)] * STAGING_BUFFERS
            self._copying = [None] * STAGING_BUFFERS
        pending = self._copying[self._next]
        if pending is not None:
            pending.wait()
            self._copying[self._next] = None
        if self._buffers[self._next].numel() < numel:
            self._buffers[self._next] = host_empty(numel, self._dtype, self._pin)
        return self._buffers[self._next][:numel]


class HostShards:
    """A unit's shards with the master and/or the parameter shard in CPU memory ([Note: offload beside a
    device]).

    ``params_on_host``: stage 3 keeps the compute-dtype parameter shard in (pinned) CPU memory
    (``offload_param``); otherwise a stage-3 unit keeps it on the device. ``staging`` is the engine's ring
    of pinned buffers in the compute dtype.
    """

    def __init__(
        self, unit: FlatUnit, copies: Copies, staging: StagingRing, *, params_on_host: bool, pin: bool
    ) -> None:
        self._copies = copies
        self._staging = staging
        self._to_device: list[Copy] = []  # copies into device memory not yet waited for on the device
        self._to_host: list[Copy] = []  # copies into host memory not yet waited for by the host
        self._ahead: tuple[torch.Tensor, Copy] | None = None  # a host shard's copy on the device
        self._param: torch.Tensor | None = None  # stage 3: the parameter shard between uses
        self._param_is_master = False
        self.prefetches = False
        if not unit.plan.shard_parameters:
            return
        master, compute = unit.master, unit.policy.compute
        if params_on_host:
            self.prefetches = True
            if master.device.type == "cpu" and master.dtype == compute:
                self._param = master  # fp32 training: the pinned master is the parameter shard
                self._param_is_master = True
            else:
                self._param = host_empty(master.numel(), compute, pin)
                self._param.copy_(master)
        else:
            self._param = master.to(unit.device, compute)

    def param_shard(self, unit: FlatUnit) -> torch.Tensor:
        if self._param is None:
            return unit.own_full_shard()
        if self._param.device == unit.device and not self.prefetches:
            self._flush_device()
            return self._param
        self.prefetch(unit)
        if self._ahead is None:
            raise RuntimeError(f"unit {unit.index} ({unit.names[0]}): no device copy of its parameter shard")
        buf, copy = self._ahead
        copy.wait_on_device()
        return buf

    def prefetch(self, unit: FlatUnit) -> None:
        if not self.prefetches or self._ahead is not None or self._param is None:
            return
        self._flush_host()  # a copy into the host shard lands before one out of it starts
        buf = torch.empty(self._param.numel(), dtype=self._param.dtype, device=unit.device)
        self._ahead = (buf, self._copies.start(buf, self._param))

    def gathered(self, unit: FlatUnit) -> None:
        self._ahead = None  # the all-gather read it and is done

    def _forget_ahead(self) -> None:
        """The host shard is about to change: a copy of it read ahead is stale (and must finish reading)."""
        if self._ahead is not None:
            self._ahead[1].wait()
            self._ahead = None

    def master_to_full(self, unit: FlatUnit, values: torch.Tensor | None = None, start: int = 0) -> None:
        source = unit.master if values is None else values
        if self._param is None:
            target = unit.own_full_shard()[start : start + source.numel()]
        else:
            target = self._param[start : start + source.numel()]
        if target.data_ptr() == source.data_ptr() and target.device == source.device:
            self._forget_ahead()  # the master is the parameter shard: stepped in place
            return
        if target.device.type == "cpu" and self.prefetches:
            self._forget_ahead()
            if source.device.type == "cpu":
                self._flush_host()
                target.copy_(source)
            else:  # the master on the device: cast there, copy the compute-dtype values over
                self._to_host.append(self._copies.start(target, source.to(target.dtype)))
            return
        if source.device.type == "cpu":
            self._to_device.extend(self._staging.send(target, source))
        else:
            target.copy_(source)

    def full_to_master(self, unit: FlatUnit, full_shard: torch.Tensor) -> None:
        self._flush_device()
        self._flush_host()  # a copy still landing in the host shard would overwrite the new values
        self._forget_ahead()
        if full_shard.data_ptr() != unit.master.data_ptr():
            unit.master.copy_(full_shard)
        if self._param is not None and self._param.data_ptr() != unit.master.data_ptr():
            self._param.copy_(full_shard)

    def master_piece(self, unit: FlatUnit, start: int, numel: int) -> torch.Tensor:
        return unit.master[start : start + numel]

    def held_param_shard(self) -> torch.Tensor | None:
        return None if self._param_is_master else self._param

    def flush(self) -> None:
        """Make the copies this store started into device memory visible to the computation (the device
        waits for them). Copies into the CPU shard are waited for before anything next reads it."""
        self._flush_device()

    def _flush_device(self) -> None:
        for copy in self._to_device:
            copy.wait_on_device()
        self._to_device.clear()

    def _flush_host(self) -> None:
        for copy in self._to_host:
            copy.wait()
        self._to_host.clear()
