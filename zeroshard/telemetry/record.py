"""`StepRecord`: what the engine reports to telemetry after each optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepRecord"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step, as rank 0 reports it right after the step.

    The grad norm and the counters are the same on every rank. The loss is the mean over all ranks at the
    steps where the ranks share it (see `Telemetry.end_step`). `memory_bytes`, `comm_bytes` and
    `comm_wait_s` are rank 0's; `rank_memory_bytes` has every rank's memory at `steps_per_print` steps.
    """

    global_step: int
    """Optimizer steps taken so far, this one included (1 after the first step)."""
    global_samples: int
    """Samples consumed over all ranks so far, this step included; the monitors' x-axis, as in DeepSpeed."""
    loss: float | None
    """The step's training loss, the mean over its micro-batches and over all ranks; None when it was not
    gathered at this step."""
    lr: list[float]
    """Learning rate of each parameter group that this step applied (DeepSpeed reports the rate after the
    scheduler's step instead: the next step's)."""
    loss_scale: float | None
    """fp16 dynamic loss scale, None without fp16."""
    grad_norm: float | None
    """Global gradient norm before clipping, None when not computed."""
    skipped_steps: int
    """Steps skipped so far because of fp16 overflow."""
    step_time_s: float
    """Wall-clock seconds of this optimizer step, forward of its first micro-batch to the end of step()."""
    samples_per_s: float
    """Throughput over all ranks: train_batch_size / step_time_s."""
    comm_bytes: int
    """Bytes this rank moved in model-state collectives during this step (see zeroshard/core/comm.py)."""
    comm_wait_s: float
    """Seconds this rank was blocked waiting for those collectives during this step, gradient reductions
    in the backward hooks included ([Note: communication wait] in zeroshard/core/comm.py)."""
    memory_bytes: int
    """This rank's model-state memory (`engine.memory_breakdown().total`)."""
    cross_node_bytes: int = 0
    """Bytes this rank sent to ranks on other nodes during this step (zeroshard/core/traffic.py [Note: bytes
    across nodes]); 0 on one node."""
    rank_memory_bytes: list[int] | None = None
    """Every rank's `memory_bytes`, in rank order, at `steps_per_print` steps; None at other steps."""
