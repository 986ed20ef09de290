"""`StepRecord`: what the engine reports to telemetry after each optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepRecord"]


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One optimizer step, as seen by this rank right after it.

    Values that are global (loss, grad norm, counters) are the same on every rank; `memory_bytes` and
    `comm_bytes` are this rank's.
    """

    global_step: int
    """Optimizer steps taken so far, this one included (1 after the first step)."""
    global_samples: int
    """Samples consumed over all ranks so far, this step included; the monitors' x-axis, as in DeepSpeed."""
    loss: float | None
    """The step's training loss (mean over its micro-batches), or None when the engine did not see it."""
    lr: list[float]
    """Learning rate of each parameter group after the step."""
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
    """Bytes this rank moved in model-state collectives during this step (see zeroshard/comm.py)."""
    memory_bytes: int
    """This rank's memory: model states held (CPU) or peak allocated device memory (CUDA)."""
