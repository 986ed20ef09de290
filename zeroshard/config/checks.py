"""Rules that relate several settings, checked on the validated config.

Errors mirror what DeepSpeed rejects (fp16 with bf16, partial offload below stage 3, ...); warnings
point at settings DeepSpeed silently ignores.
"""

from __future__ import annotations

from zeroshard.config.errors import Problems
from zeroshard.config.schema import ZeroshardConfig

__all__ = ["check_config"]


def _precision(cfg: ZeroshardConfig, problems: Problems) -> None:
    stage = cfg.zero_optimization.stage
    if cfg.fp16.enabled and cfg.bf16.enabled:
        problems.add(
            "fp16.enabled and bf16.enabled are both true; enable one of them (DeepSpeed rejects this too)"
        )
    fp16 = cfg.fp16
    if fp16.enabled and fp16.loss_scale == 0:
        if fp16.loss_scale_window <= 0:
            problems.add(
                f"fp16.loss_scale_window: {fp16.loss_scale_window} is not allowed; expected a value > 0 "
                f"with dynamic loss scaling (loss_scale 0)"
            )
        if fp16.min_loss_scale <= 0:
            problems.add(
                f"fp16.min_loss_scale: {fp16.min_loss_scale:g} is not allowed; expected a value > 0 "
                f"with dynamic loss scaling (loss_scale 0)"
            )
    needs_zero = (
        ("fp16.fp16_master_weights_and_grads", fp16.fp16_master_weights_and_grads),
        ("bf16.bf16_master_weights_and_grads", cfg.bf16.bf16_master_weights_and_grads),
        ("bf16.bf16_optimizer_states", cfg.bf16.bf16_optimizer_states),
    )
    for key, value in needs_zero:
        if value and stage == 0:
            problems.add(f"{key}: true needs zero_optimization.stage 1, 2 or 3 (it is 0)")
    if cfg.bf16.bf16_optimizer_states and not cfg.bf16.bf16_master_weights_and_grads:
        problems.add("bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads: true")


def _offload(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    zero = cfg.zero_optimization
    for name, block in (("offload_param", zero.offload_param), ("offload_optimizer", zero.offload_optimizer)):
        if block.device == "nvme" and not block.nvme_path:
            problems.add(f'zero_optimization.{name}.nvme_path: required when device is "nvme"')
    if zero.offload_optimizer.ratio < 1.0 and zero.stage != 3:
        problems.add(
            f"zero_optimization.offload_optimizer.ratio: {zero.offload_optimizer.ratio:g} is not allowed at "
            f"stage {zero.stage}; partial offload needs stage 3"
        )
    if zero.offload_param.device != "none" and zero.stage != 3:
        notes.append(
            f"zero_optimization.offload_param has no effect at stage {zero.stage}: parameters are only "
            f"offloaded at stage 3 (DeepSpeed ignores it too)"
        )
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        notes.append(
            "zero_optimization.offload_optimizer has no effect at stage 0 (DeepSpeed ignores it too)"
        )


def _allreduce_op(cfg: ZeroshardConfig, problems: Problems) -> None:
    if cfg.gradient_allreduce_op != "sum":
        return
    if cfg.zero_optimization.stage == 3:
        problems.add(
            'gradient_allreduce_op: "sum" is not allowed at zero_optimization.stage 3; expected "mean"'
        )
    if cfg.zero_optimization.zenflow is not None:
        problems.add('gradient_allreduce_op: "sum" is not allowed with zero_optimization.zenflow')
    if cfg.compile.deepcompile:
        problems.add('gradient_allreduce_op: "sum" is not allowed with compile.deepcompile')


def check_config(cfg: ZeroshardConfig, problems: Problems, notes: list[str]) -> None:
    """Records cross-setting errors in `problems` and warnings about ignored settings in `notes`."""
    _precision(cfg, problems)
    _offload(cfg, problems, notes)
    _allreduce_op(cfg, problems)
    if cfg.optimizer is not None:
        max_norm = cfg.optimizer.params.get("max_grad_norm")
        if isinstance(max_norm, int | float) and max_norm > 0:
            notes.append(
                f"optimizer.params.max_grad_norm ({max_norm}) is not used for clipping; set "
                f"gradient_clipping instead (DeepSpeed warns about this too)"
            )
