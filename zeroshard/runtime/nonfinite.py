"""What a step does when the gradients are not finite and no loss scaler handles it.

[Note: non-finite gradients]
The global gradient norm is inf or NaN in fp32: as DeepSpeed's ZeRO optimizer does, the engine skips the
step (no optimizer or scheduler step, ``skipped_steps`` counts it), so one bad batch does not turn every
weight into NaN (fp16 skips through its loss scaler, bf16 when ``bf16.check_grad_overflow`` asks, as in
DeepSpeed); with ``ZEROSHARD_STOP_ON_NONFINITE=1`` every rank raises ``FloatingPointError`` instead,
naming the step and the parameters whose gradients are not finite. Every rank sees the same norm, so every
rank takes the same branch.
"""

from __future__ import annotations

import logging
import os

from zeroshard.core.comm import Comm
from zeroshard.core.loss_scaler import LossScaleFloorError
from zeroshard.core.optimizer import ShardedStep

logger = logging.getLogger(__name__)

# Set to 1: a non-finite gradient norm without loss scaling raises instead of skipping the step.
STOP_ON_NONFINITE = "ZEROSHARD_STOP_ON_NONFINITE"


def nonfinite_names(comm: Comm, sharded_step: ShardedStep) -> list[str]:
    """Every rank's parameters whose gradients are not finite, sorted. Collective: all ranks of ``comm``."""
    gathered = comm.all_gather_object(sharded_step.nonfinite_names())
    return sorted({name for names in gathered for name in names})


def stop_or_warn(comm: Comm, sharded_step: ShardedStep, *, step: int, grad_norm: float) -> None:
    """Raise ``FloatingPointError`` under ``ZEROSHARD_STOP_ON_NONFINITE=1``; otherwise warn (rank 0) that
    step ``step`` is skipped ([Note: non-finite gradients]). Collective: all ranks of ``comm``."""
    if os.environ.get(STOP_ON_NONFINITE, "") == "1":
        names = nonfinite_names(comm, sharded_step)
        raise FloatingPointError(
            f"rank {comm.rank}: step {step}: the gradients are not finite (norm {grad_norm}); parameters "
            f"with non-finite gradients: {', '.join(names) or '(none found)'} ({STOP_ON_NONFINITE}=1 stops "
            "here; without it the step is skipped)"
        )
    if comm.rank == 0:
        logger.warning(
            "step %d skipped: the gradient norm is %s (a non-finite loss or gradient); set %s=1 to stop "
            "with an error instead",
            step,
            grad_norm,
            STOP_ON_NONFINITE,
        )


def loss_scale_floor_error(
    comm: Comm, sharded_step: ShardedStep, *, step: int, min_scale: float
) -> LossScaleFloorError:
    """The error for fp16 gradients that overflow at the minimum loss scale, naming the parameters.
    Collective: all ranks of ``comm``."""
    names = nonfinite_names(comm, sharded_step)
    return LossScaleFloorError(
        f"fp16 gradients overflowed at the minimum loss scale ({min_scale:g}) at step {step}; parameters "
        f"with non-finite gradients: {', '.join(names) or '(none found)'}. Lower the learning rate or "
        "fp16.min_loss_scale, check the model for inf/NaN, or train in bf16 (bf16.enabled: true), whose "
        "range does not need loss scaling"
    )
