"""The training engine: DeepSpeed's engine API over zeroshard's units, reducer and sharded step.

A training step, as the user drives it::

    loss = engine(batch)      # the module's forward, unchanged
    engine.backward(loss)     # loss / gas; backward; gradients reduced per unit as they are ready
    engine.step()             # at the accumulation boundary: clip, optimizer step, scheduler, all-gather

The engine owns the bookkeeping of the loop (micro-steps, the accumulation boundary, counters, the
scheduler); how units are laid out and reduced lives in ``flat_param``, ``grad_sync`` and ``optimizer``.
Non-finite gradients: ``nonfinite.py``; checkpoint methods: ``checkpointing.py``; read-only queries:
``measurements.py``; DeepSpeed's other engine names: ``surface.py``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.config import ZeroshardConfig
from zeroshard.core.comm import Comm
from zeroshard.core.flat_param import FlatUnit
from zeroshard.core.grad_sync import GradientReducer
from zeroshard.core.hybrid import ShardGroups
from zeroshard.core.liveness import collective_api
from zeroshard.core.loss_scaler import LossScaleFloorError, LossScaler
from zeroshard.core.optimizer import ShardedStep
from zeroshard.core.precision import cast_floating
from zeroshard.core.stage3.gatherer import ParameterGatherer
from zeroshard.core.stages import StagePlan
from zeroshard.errors import UsageError
from zeroshard.offload.setup import Offload
from zeroshard.runtime.checkpointing import CheckpointMethods, close_checkpoint_writer
from zeroshard.runtime.data import ResumableDataLoader
from zeroshard.runtime.measurements import EngineMeasurements
from zeroshard.runtime.nonfinite import loss_scale_floor_error, stop_or_warn
from zeroshard.runtime.python_gc import hold_python_gc
from zeroshard.runtime.queries import DeepSpeedQueries
from zeroshard.telemetry import Telemetry
from zeroshard.zero import TrainedParameters

logger = logging.getLogger(__name__)


class ZeroshardEngine(EngineMeasurements, DeepSpeedQueries, CheckpointMethods):
    """Wraps a model for ZeRO data-parallel training. Build it with :func:`zeroshard.initialize`.

    Collective: every rank of the data-parallel group calls ``backward`` and ``step`` equally often.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: ZeroshardConfig,
        plan: StagePlan,
        comm: Comm,
        units: Sequence[FlatUnit],
        reducer: GradientReducer,
        sharded_step: ShardedStep,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Any | None,
        local_rank: int,
        device: torch.device | None = None,
        loss_scaler: LossScaler | None = None,
        gatherer: ParameterGatherer | None = None,
        offload: Offload | None = None,
        trained: TrainedParameters,
        sharding: ShardGroups,
    ) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.plan = plan
        self.comm = comm  # every data-parallel rank; the units may shard over fewer (hybrid.py)
        self.sharding = sharding
        self.units = list(units)
        self.reducer = reducer
        self.sharded_step = sharded_step
        self.optimizer = optimizer
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._refuse_direct_step)
        self.lr_scheduler = lr_scheduler
        self.local_rank = local_rank
        self.device = device or torch.device("cpu")  # where the module computes: move inputs here
        self.loss_scaler = loss_scaler
        self.gatherer = gatherer
        self.offload = offload or Offload()
        self.trained = trained  # which unit holds each parameter ([Note: parameter owners])
        # The loader initialize(training_data=...) built, if any: checkpoints carry its position (data.py).
        self.training_dataloader: ResumableDataLoader | None = None
        self.telemetry = Telemetry.from_config(config, rank=comm.rank, world_size=comm.world_size, comm=comm)
        policy = self.units[0].policy if self.units else None
        # A step is skipped when any rank's gradients are not finite: always under fp16 loss scaling,
        # under bf16 when bf16.check_grad_overflow asks for it.
        self._check_overflow = loss_scaler is not None or (
            policy is not None and policy.compute == torch.bfloat16 and config.bf16.check_grad_overflow
        )
        # fp32: a non-finite gradient norm skips the step too, as DeepSpeed's ZeRO optimizer; bf16 without
        # check_grad_overflow steps anyway, as DeepSpeed's does (nonfinite.py [Note: non-finite gradients]).
        self._skip_nonfinite_norm = policy is None or policy.compute == torch.float32
        self._cast_inputs = torch.float16 if config.fp16.enabled and config.fp16.auto_cast else None
        self.global_rank = comm.rank
        self.world_size = comm.world_size
        self.global_steps = self.micro_steps = self.global_samples = self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._backward_since_step = False
        self._no_sync = False
        self._report_overflow(False)
        self._python_gc = hold_python_gc(self) if config.disable_python_gc else None  # python_gc.py

    # -- the loop ------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cast_inputs is not None:  # fp16.auto_cast: floating inputs follow the fp16 parameters
            args, kwargs = cast_floating((args, kwargs), self._cast_inputs)
        self.tput_timer.start()  # DeepSpeed's throughput timer: forward to step() (telemetry/throughput.py)
        with self.telemetry.timer("forward"), self.comm.monitor.api("engine.forward", self.global_steps):
            return self._forward(args, kwargs)

    def _forward(self, args: Any, kwargs: Any) -> Any:
        if self.gatherer is None:
            return self.module(*args, **kwargs)
        # The first forwards watch for parameters used outside their module: eager, also when compiled.
        stance = "force_eager" if self.gatherer.discovering else "default"
        try:
            with torch.compiler.set_stance(stance):
                output = self.module(*args, **kwargs)
        except RuntimeError as err:
            # Keep torch's exception (type and traceback: `except torch.OutOfMemoryError` must still work);
            # only add what a stage-3 shape error most often means.
            err.add_note(
                "(zeroshard, ZeRO stage 3: between uses a parameter is an empty placeholder and is gathered "
                "only when the module that owns it runs. If the model uses a parameter outside its own "
                "module, e.g. F.linear(x, other.weight), call "
                "zeroshard.register_external_parameter(module_that_uses_it, param).)"
            )
            raise
        self.gatherer.end_forward(backward_follows=torch.is_grad_enabled())
        return output

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by gradient_accumulation_steps) and reduce gradients.

        Collective: call on all ranks, once per micro-batch.
        """
        with self.comm.monitor.api("engine.backward", self.global_steps):
            return self._backward(loss, retain_graph, scale_wrt_gas)

    def _backward(self, loss: torch.Tensor, retain_graph: bool, scale_wrt_gas: bool) -> torch.Tensor:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"backward() needs a scalar loss tensor, got {shape}; reduce it first, e.g. loss.mean()"
            )
        if not loss.requires_grad:
            raise ValueError(
                "backward() got a loss that does not require grad: was it computed under no_grad()?"
            )
        self.telemetry.add_loss(loss)  # the micro-batch's loss as the script computed it
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            loss = loss / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        # Reduce on the boundary micro-step (every micro-step when the stage shards gradients).
        self.reducer.begin_backward(reduce=self.is_gradient_accumulation_boundary() and not self._no_sync)
        if self.gatherer is not None:
            self.gatherer.begin_backward()
        # "reduce" is the time blocked on gradient reductions, in the hooks as well as in finish_backward.
        with self.telemetry.timer("backward"), self.telemetry.reduce_timer():
            loss.backward(retain_graph=retain_graph)
            self.reducer.finish_backward()
        if self.gatherer is not None:
            self.gatherer.end_backward()
        self._backward_since_step = True
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; at the accumulation boundary, update the parameters.

        Collective: call on all ranks, once per micro-batch, after ``backward``.
        """
        with self.comm.monitor.api("engine.step", self.global_steps):
            self._step(lr_kwargs)

    def _step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if self._no_sync:
            raise UsageError(
                "It is illegal to call Engine.step() inside no_sync context manager: leave the block first "
                "(the boundary micro-batch's backward, outside it, reduces the gradients the step applies)"
            )
        if not self._backward_since_step:
            self._take_plain_gradients()  # loss.backward() instead of engine.backward(loss)
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            lr = self.get_lr()  # the rate this step applies: the scheduler moves it inside the step
            with self.telemetry.timer("step"):
                self._take_model_step(lr_kwargs)
            self.telemetry.add_times(self.step_breakdown())  # offload's phases, with wall_clock_breakdown
            self._report_step(lr)
        self.micro_steps += 1
        self._backward_since_step = False
        self.tput_timer.stop(global_step=boundary, report_speed=False)  # steps_per_print reports the rate

    def _refuse_direct_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer steps the master shards inside ``engine.step()`` only, which first reduces, unscales
        and clips their gradients; stepped directly it would see no gradients and silently change nothing."""
        if not self.sharded_step.stepping:
            raise RuntimeError(
                f"rank {self.comm.rank}: optimizer.step() was called on the optimizer initialize() returned; "
                "zeroshard updates the parameters in engine.step() (which reduces, unscales and clips the "
                "gradients first): call engine.step() instead"
            )

    def _take_plain_gradients(self) -> None:
        """PyTorch style, ``loss.backward(); engine.step()``: the gradients are in ``param.grad``.

        They accumulate there over the micro-steps, as in PyTorch; at the accumulation boundary they are
        scaled as ``engine.backward`` scales its loss (by 1 / gradient_accumulation_steps, and by the fp16
        loss scale that the step then divides out, unless ``engine.scale(loss)`` applied it already) and
        reduced like one backward, so the update equals ``engine.backward(loss)``'s. Until then full-size
        gradients stay in memory, as in DDP: at stages 2 and 3, ``engine.backward`` is the path that keeps
        only shards.

        Collective at the boundary: call on all ranks.
        """
        scaled = self._plain_loss_was_scaled(self.is_gradient_accumulation_boundary())  # engine.scale()
        local = any(p.grad is not None for p in self.module.parameters())
        boundary = self.is_gradient_accumulation_boundary()  # there, whether any rank has gradients
        if not (bool(self.comm.any_true(torch.tensor([local])).item()) if boundary else local):
            raise RuntimeError(
                "step() found no gradients: call engine.backward(loss) or loss.backward() first"
            )
        if not boundary:
            return
        factor = 1.0 / self.config.gradient_accumulation_steps
        if self.loss_scaler is not None and not scaled:
            factor *= self.loss_scaler.scale
        self.reducer.begin_backward(reduce=not self._no_sync)
        self.reducer.take_plain_gradients(factor)
        self.reducer.finish_backward()
        if self.gatherer is not None:
            self.gatherer.end_backward()

    def _take_model_step(self, lr_kwargs: dict[str, Any] | None) -> None:
        if self.reducer.needs_reduction:
            raise RuntimeError(
                "step() at the accumulation boundary found gradients that were never reduced across ranks: "
                "run the boundary micro-batch's backward() outside engine.no_sync()"
            )
        if self.optimizer is None:
            raise UsageError(
                "step() needs an optimizer: pass optimizer= to initialize() or an 'optimizer' block"
            )
        step = self.sharded_step
        step.prepare()
        try:
            # The overflow flag, the global gradient norm and which parameters got a gradient anywhere
            # (the others are skipped, as torch skips them): one small all-reduce.
            checks = step.checks(self.reducer.local_has_grad(), check_overflow=self._check_overflow)
            if checks.nonfinite:
                self._skip_step()
                return
            scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
            step.attach_grads(checks.has_grad)
            self._grad_norm = checks.grad_norm / scale
            if self._skip_nonfinite_norm and not math.isfinite(self._grad_norm):
                # Skip the step, or stop under ZEROSHARD_STOP_ON_NONFINITE=1 ([Note: non-finite gradients]).
                stop_or_warn(self.comm, step, step=self.global_steps, grad_norm=self._grad_norm)
                self._skip_step()
                return
            # Unscale and clip in one pass over the gradients.
            factor = (1.0 / scale) * step.clip_coefficient(self._grad_norm, self.config.gradient_clipping)
            if factor != 1.0:
                step.scale_grads(factor)
            step.run(self.optimizer)
        finally:
            step.release()
        if self.loss_scaler is not None:
            self.loss_scaler.update(False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        step.gather_params()
        self._finish_step()

    def _skip_step(self) -> None:
        """Some rank's gradients overflowed: no optimizer or scheduler step; shrink the loss scale."""
        if self.loss_scaler is not None:
            try:
                self.loss_scaler.update(True)
            except LossScaleFloorError as err:
                raise loss_scale_floor_error(
                    self.comm, self.sharded_step, step=self.global_steps, min_scale=self.loss_scaler.min_scale
                ) from err
        self.skipped_steps += 1
        self._grad_norm = None
        logger.info("rank %d: step %d skipped: non-finite gradients", self.global_rank, self.global_steps)
        self._finish_step(skipped=True)

    def _finish_step(self, skipped: bool = False) -> None:
        self._report_overflow(skipped)  # optimizer.overflow, DeepSpeed's flag (surface.py)
        self.reducer.zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size

    def _report_step(self, lr: list[float]) -> None:
        """Hand this optimizer step's figures to the telemetry (rank 0 logs and writes the monitors).

        Collective at some steps: every rank reaches it at every boundary (see Telemetry.end_step).
        """
        self.telemetry.end_step(
            global_step=self.global_steps,
            global_samples=self.global_samples,
            lr=lr,
            loss_scale=self.loss_scaler.scale if self.loss_scaler is not None else None,
            grad_norm=self._grad_norm,
            skipped_steps=self.skipped_steps,
            memory_bytes=lambda: self.memory_breakdown().total,
        )

    def destroy(self) -> None:
        """Flush and close the monitors, remove zeroshard's hooks and this rank's offload files, free the idle
        buffers the pool keeps (buffers.py [Note: buffer reuse]) and end ``disable_python_gc``'s hold. An
        asynchronous save in flight is finished first, without a collective ([Note: async save])."""
        close_checkpoint_writer(self)
        self.telemetry.close()
        self.offload.close()
        self.reducer.remove_hooks()
        if self.gatherer is not None:
            self.gatherer.remove()
        self.reducer.pool.clear()
        if self._python_gc is not None:
            self._python_gc()  # [Note: Python GC switch]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients (the engine already does this after each step): the engine's own,
        and any ``param.grad`` a backward it did not run left behind, dropped or, with ``set_to_none=False``,
        zeroed in place (as ``torch.optim.Optimizer.zero_grad`` does)."""
        self.reducer.zero_grad()
        for p in self.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for the backwards inside (stages 0 and 1 only), as DeepSpeed's.

        The gradients accumulate locally; the boundary micro-batch's backward, outside the block, reduces
        them all. ``step()`` inside the block is refused, and so is entering the block again inside itself,
        as DeepSpeed refuses both.

        Raises:
            UsageError: At ZeRO stage 2 or 3, or inside ``no_sync()`` already; a ``RuntimeError`` and
                DeepSpeed's ``AssertionError`` ([Note: DeepSpeed's exception types] in errors.py).
        """
        if not self.plan.allows_no_sync:
            raise UsageError(
                f"no_sync context manager is incompatible with ZeRO stage {self.plan.stage}: gradients are "
                "reduce-scattered during every backward so that only a shard is kept; use stage 0 or 1, or "
                "rely on gradient_accumulation_steps"
            )
        if self._no_sync:
            raise UsageError("no_sync context manager reentry is unsupported: use one block per window")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Hold the whole model gathered inside the block: no per-module communication (stage 3).

        For evaluation, generation (``model.generate``) or inspecting ``engine.module``'s parameters: one
        all-gather per unit on entry, none while the block runs, parameters re-partitioned on exit. A
        no-op at stages 0-2, where parameters are always full. Collective: enter on all ranks.
        """
        if self.gatherer is None:
            yield
            return
        with collective_api(self.comm, "gathered_parameters", self.global_steps), self.gatherer.hold_all():
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with full tensors (copies, in the module's dtype, on its device), on every
        rank. Collective at stage 3: call on all ranks ([Note: local state_dict] in state_dict_hooks.py)."""
        with collective_api(self.comm, "full_state_dict", self.global_steps, check=self.gatherer is not None):
            with self.gathered_parameters():
                return {key: value.detach().clone() for key, value in self.module.state_dict().items()}
