"""Dtype policy: which dtype each kind of tensor is held and communicated in.

[Note: dtype vocabulary]
*compute dtype*: the full parameters the model computes with (and their gradients from autograd).
*master dtype*: the shard the optimizer steps (fp32). When it equals the compute dtype at stages 0-2, the
master shard is a view of the full parameters, so fp32 training holds no second copy.
*reduce dtype*: gradients travel between ranks in it. *accumulation dtype*: gradient shards are summed over
micro-steps in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DtypePolicy:
    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    accumulate: torch.dtype = torch.float32

    @property
    def master_is_compute(self) -> bool:
        return self.compute == self.master


FP32 = DtypePolicy()
