"""The part of DeepSpeed's engine API that integrations call and the training loop does not need.

:class:`DeepSpeedSurface` is a base class of :class:`zeroshard.ZeroshardEngine`: the names DeepSpeed code
(Hugging Face transformers and accelerate, Lightning, TRL, DeepSpeedExamples) calls on an engine, each a
few lines over the engine's own state. The loop itself (forward, backward, step) stays in ``engine.py``.

Attribute forwarding: a name the engine does not have is looked up on the wrapped module, as DeepSpeed
does, so ``engine.generate(...)`` or ``engine.config_class`` reach the model.
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.errors import ArgumentError, UsageError
from zeroshard.runtime.state_offload import (
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    StateOffload,
    require_offloadable,
)
from zeroshard.telemetry.monitors import MonitorMaster
from zeroshard.telemetry.throughput import ThroughputTimer

if TYPE_CHECKING:
    from zeroshard.config import ZeroshardConfig
    from zeroshard.core.comm import Comm
    from zeroshard.core.flat_param import FlatUnit
    from zeroshard.core.grad_sync import GradientReducer
    from zeroshard.core.loss_scaler import LossScaler
    from zeroshard.core.stages import StagePlan
    from zeroshard.telemetry.telemetry import Telemetry

__all__ = ["DeepSpeedSurface"]


class DeepSpeedSurface(nn.Module):
    """DeepSpeed engine names over the engine's state (see the module docstring)."""

    # Set by ZeroshardEngine.__init__.
    module: nn.Module
    config: ZeroshardConfig
    comm: Comm
    global_steps: int
    global_samples: int
    plan: StagePlan
    units: list[FlatUnit]
    optimizer: torch.optim.Optimizer | None
    loss_scaler: LossScaler | None
    reducer: GradientReducer
    telemetry: Telemetry
    _grad_norm: float | None
    _boundary_override: bool | None = None
    _tput_timer: ThroughputTimer | None = None
    _compiled: bool = False
    _last_step_overflowed: bool = False
    _scale_called: bool = False  # engine.scale() ran since the last step()
    _window_scaled: bool | None = None  # whether this window's plain backwards went through scale()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            module = modules.get("module") if modules is not None else None
            if module is None or name.startswith("__"):
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                pass
            # Another DeepSpeedEngine method: refused when called (refused.py), never missing.
            from zeroshard.runtime.refused import refused_method  # lazily: it reads zeroshard.deepspeed

            refused = refused_method(name)
            if refused is not None:
                return refused
            raise AttributeError(
                f"neither the engine nor its module ({type(module).__name__}) has an attribute {name!r}"
            ) from None

    # -- torch.compile ---------------------------------------------------------------------------------
    def compile(
        self,
        backend: str | Callable[..., Any] = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped module in place (``module.compile(backend=..., **compile_kwargs)``),
        as DeepSpeed's ``engine.compile`` does; a second call does nothing.

        At stage 3 the gather and release hooks run eagerly between compiled pieces (one graph break per
        hooked module), so the graphs stop changing after the first two steps. DeepCompile's ``schedule``
        and compiled autograd are DeepSpeed features zeroshard does not have.
        """
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...) is DeepSpeed's DeepCompile; allowed: None")
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True) is not supported; allowed: False"
            )
        if self._compiled:
            return
        kwargs = {k: v for k, v in (compile_kwargs or {}).items() if k != "backend"}
        self.module.compile(backend=backend, **kwargs)
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._compiled

    # -- queries -------------------------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale, for a script that runs ``backward()`` itself (DeepSpeed's
        ``engine.scale``): ``engine.scale(loss).backward(); engine.step()`` gives the update
        ``engine.backward(loss); engine.step()`` gives.

        Without fp16 loss scaling the scale is 1 and ``loss`` comes back unchanged. The step takes the
        gradients in ``param.grad`` as already scaled: it divides the scale out once, and divides by
        ``gradient_accumulation_steps`` as for any plain ``loss.backward()`` (engine.py,
        ``_take_plain_gradients``). Every micro-batch of one accumulation window goes through ``scale`` or
        none does: their gradients add up in ``param.grad``, and ``step()`` refuses a mix.

        Raises:
            UsageError: There is no optimizer (nothing would step the gradients).
            ArgumentError: ``loss`` is not a one-element tensor that requires grad.
        """
        if self.optimizer is None:
            raise UsageError(
                "engine.scale(loss) needs an optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' block"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ArgumentError(f"engine.scale() needs a scalar loss tensor, got {shape}; reduce it first")
        if not loss.requires_grad:
            raise ArgumentError(
                "engine.scale() got a loss that does not require grad (computed under no_grad?)"
            )
        self._scale_called = True
        return loss * self.loss_scaler.scale if self.loss_scaler is not None else loss

    def _plain_loss_was_scaled(self, boundary: bool) -> bool:
        """At ``step()`` after a plain ``loss.backward()``: whether that loss went through :meth:`scale`
        (then the gradients carry the loss scale already). Consistent over one accumulation window.

        Raises:
            ArgumentError: Some micro-batches of this window went through ``scale`` and others did not.
        """
        scaled, self._scale_called = self._scale_called, False
        window = self._window_scaled
        self._window_scaled = None if boundary else scaled  # a window ends at its boundary step
        if window is not None and window != scaled:
            raise ArgumentError(
                "engine.scale(loss) was used for some micro-batches of this accumulation window and not for "
                "others: their gradients add up in param.grad, so use it for every micro-batch or for none"
            )
        return scaled

    def empty_partition_cache(self) -> None:
        """Free the memory kept between steps for gathering and reducing (DeepSpeed's
        ``empty_partition_cache``): the idle buffers the engine's pool keeps for reuse (buffers.py
        [Note: buffer reuse]) and, on CUDA, the caching allocator's unused blocks.

        Nothing gathered is released: between steps a stage-3 unit holds only its shard unless a
        ``GatheredParameters`` block holds it, and such a block keeps it. The next step allocates its
        buffers again, so call this where memory matters more than that (before generation, evaluation
        or saving). Not collective; results do not change.
        """
        self.reducer.pool.clear()
        gc.collect()
        if self.comm.device.type == "cuda":
            torch.cuda.empty_cache()

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last step, before clipping (None before the first step, and always with
        ``zero_optimization.compute_grad_norm: false``; inf when the last step was skipped for non-finite
        gradients, as DeepSpeed reports it)."""
        if not self.config.zero_optimization.compute_grad_norm:
            return None
        if self._last_step_overflowed:
            return float("inf")
        return self._grad_norm

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    # -- precision and ZeRO queries ------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def amp_enabled(self) -> bool:
        return False

    def zero_optimization(self) -> bool:
        return int(self.config.zero_optimization.stage) > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return int(self.config.zero_optimization.stage) >= 2

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``zero_optimization.gather_16bit_weights_on_model_save`` (what Hugging Face reads to
        decide whether ``save_16bit_model`` may consolidate at stage 3)."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    # -- the accumulation boundary, driven from outside ------------------------------------------------
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the next ``backward``/``step`` ends an accumulation window (accelerate's loop).

        From the first call on, ``is_gradient_accumulation_boundary()`` answers ``is_boundary`` instead
        of counting micro-steps: accelerate calls this before every ``backward`` and ``step()`` only at
        the boundary, which gives the same update as the counted per-micro-batch loop.
        """
        if not isinstance(is_boundary, bool):
            raise TypeError(
                "set_gradient_accumulation_boundary(is_boundary=...) needs True or False, "
                f"got {is_boundary!r}"
            )
        self._boundary_override = is_boundary

    def _report_overflow(self, skipped: bool) -> None:
        """Set DeepSpeed's ``optimizer.overflow``: whether the last step was skipped for non-finite
        gradients (False before the first). accelerate reads it (``optimizer.step_was_skipped``,
        ``accelerator.optimizer_step_was_skipped``) to hold a torch LR scheduler back on a skipped step, as
        the engine holds back its own scheduler."""
        self._last_step_overflowed = skipped
        if self.optimizer is not None:
            self.optimizer.overflow = skipped  # type: ignore[attr-defined]

    @property
    def tput_timer(self) -> ThroughputTimer:
        """DeepSpeed's throughput timer, started by ``forward`` and stopped by ``step`` ([Note: throughput
        timer])."""
        if self._tput_timer is None:
            self._tput_timer = ThroughputTimer(
                self.config.timers.throughput,
                batch_size=self.config.train_batch_size,
                steps_per_output=self.config.steps_per_print,
            )
        return self._tput_timer

    @property
    def monitor(self) -> MonitorMaster:
        """DeepSpeed's ``engine.monitor``: ``write_events([(name, value, x), ...])`` writes a script's own
        events to the config's TensorBoard, CSV and W&B monitors on rank 0, beside the engine's; ``enabled``
        says whether the config enables one."""
        return MonitorMaster(self.telemetry.monitors, self.telemetry.monitored)

    # -- consolidated weights --------------------------------------------------------------------------
    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict[str, torch.Tensor]:
        """The module's state dict in the compute dtype, gathered, on CPU; on rank 0 only (others: empty).

        Keys and order are ``module.state_dict()``'s; tied parameters are one tensor under each of their
        names, as in DeepSpeed (``save_model`` and ``save_pretrained`` drop the repeats when they write).
        Collective: call on all ranks.
        """
        from zeroshard.checkpoint.common import module_names
        from zeroshard.checkpoint.export import live_state

        names = module_names(self.module, self.units)
        specs, tensors = live_state(self, exclude_frozen_parameters=exclude_frozen_parameters)
        gathered: dict[str, torch.Tensor] = {}
        for spec, tensor in zip(specs, tensors, strict=True):  # every rank takes part in each gather
            if self.comm.rank == 0:
                gathered[spec.key] = tensor
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        if self.comm.rank != 0:
            return out
        for key in names.state_keys:
            source = names.aliases.get(key, key)
            if source in gathered:
                out[key] = gathered[source]
        return out

    # -- model state off the accelerator and back (state_offload.py) ---------------------------------
    _state_offload: StateOffload | None = None

    def offload_states(
        self,
        include: Iterable[OffloadStateTypeEnum | str] | None = None,
        device: OffloadDeviceEnum | str = OffloadDeviceEnum.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move this rank's model state off the accelerator until :meth:`reload_states` (DeepSpeed's
        ``engine.offload_states``): the optimizer state, masters, parameters and gradients, or the kinds
        ``include`` names (``OffloadStateTypeEnum``), to ``device`` (``cpu``; ``none`` does nothing).

        Call it between steps and ``reload_states()`` before the next forward; training then goes on
        bit-identical to never offloading ([Note: moving states] in ``state_offload.py``). ZeRO stages
        1-3, as in DeepSpeed 0.19 (stage 0 raises ``AttributeError`` there too); any torch optimizer
        (DeepSpeed 0.19 requires its FusedAdam at stage 3). Local: no communication.
        """
        optimizer = require_offloadable(
            "offload_states",
            self.plan.stage,
            self.optimizer,
            self.config.zero_optimization.offload_param.device,
        )
        if self._state_offload is None:
            self._state_offload = StateOffload()
        self._state_offload.offload(
            self.units,
            optimizer,
            include=include,
            device=device,
            pin_memory=pin_memory,
            non_blocking=non_blocking,
        )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move what :meth:`offload_states` moved back to the accelerator (nothing offloaded: nothing to
        do). Returns once the copies are done. Local: no communication."""
        require_offloadable("reload_states", self.plan.stage, self.optimizer)
        if self._state_offload is not None:
            self._state_offload.reload(non_blocking=non_blocking)
